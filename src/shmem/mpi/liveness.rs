//! Noticing that a process on another node died.
//!
//! OpenMPI 4.1 does not tell the survivors: with `MPI_ERRORS_RETURN` and `--enable-recovery`, a
//! receive from a killed rank and a send to it both stay pending for ever (measured here; without
//! `--enable-recovery` mpirun kills every process instead, and nothing reports anything). So each
//! proxy holds one TCP connection to every process of the other nodes, carrying no data: a
//! process that ends closes its connections (the kernel does so for a killed one), and its peers
//! see the end at once. A process that leaves in order writes one byte first, so an end without
//! it means the process died. Processes of this node are watched through their pids instead.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};

const HELLO: u64 = 0x6474_6c69_7665_0001; // "dtlive", version 1
const BYE: u8 = b'B';

/// Where a process listens: its host name and port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Address {
    pub(crate) host: String,
    pub(crate) port: u16,
}

impl Address {
    /// Packs into words for an all-gather: the port, then up to 64 bytes of host name.
    pub(crate) fn to_words(&self) -> [u64; 9] {
        let mut words = [0u64; 9];
        words[0] = u64::from(self.port);
        for (i, b) in self.host.bytes().take(64).enumerate() {
            words[1 + i / 8] |= u64::from(b) << (8 * (i % 8));
        }
        words
    }

    pub(crate) fn from_words(words: &[u64]) -> Address {
        let bytes: Vec<u8> =
            words[1..9].iter().flat_map(|w| w.to_le_bytes()).take_while(|&b| b != 0).collect();
        Address { host: String::from_utf8_lossy(&bytes).into_owned(), port: words[0] as u16 }
    }
}

/// A listening socket, made before the addresses are shared.
pub(crate) fn listen() -> std::io::Result<(TcpListener, u16)> {
    let listener = TcpListener::bind(("0.0.0.0", 0))?;
    let port = listener.local_addr()?.port();
    Ok((listener, port))
}

/// One connection per process of another node.
pub(crate) struct Liveness {
    links: Vec<(usize, TcpStream, bool)>,
}

impl Liveness {
    /// Connects to every rank of `remote` above `me` and accepts the ones below, within
    /// `timeout`. `addresses[r]` is where rank `r` listens; `same_host[r]` whether it is on this
    /// host (then reached through the loopback address).
    pub(crate) fn connect(
        me: usize,
        listener: TcpListener,
        addresses: &[Address],
        same_host: &[bool],
        remote: &[usize],
        timeout: Duration,
    ) -> Result<Liveness, String> {
        let deadline = Instant::now() + timeout;
        let mut links = Vec::with_capacity(remote.len());
        for &peer in remote.iter().filter(|&&p| p > me) {
            let address = &addresses[peer];
            let host = if same_host[peer] { "127.0.0.1" } else { address.host.as_str() };
            let targets: Vec<_> = (host, address.port)
                .to_socket_addrs()
                .map_err(|e| format!("cannot resolve rank {peer}'s host {host:?}: {e}"))?
                .collect();
            let mut stream = None;
            let mut last_error = String::from("no address");
            while stream.is_none() && Instant::now() < deadline {
                for target in &targets {
                    match TcpStream::connect_timeout(target, Duration::from_secs(2)) {
                        Ok(s) => {
                            stream = Some(s);
                            break;
                        }
                        Err(e) => last_error = e.to_string(),
                    }
                }
                if stream.is_none() {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            let mut stream = stream.ok_or_else(|| {
                format!("cannot reach rank {peer} at {host}:{}: {last_error}", address.port)
            })?;
            let hello = [HELLO.to_le_bytes(), (me as u64).to_le_bytes()].concat();
            stream.write_all(&hello).map_err(|e| format!("greeting rank {peer}: {e}"))?;
            links.push((peer, stream, false));
        }
        let below = remote.iter().filter(|&&p| p < me).count();
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;
        while links.len() < remote.len() {
            match listener.accept() {
                Ok((mut stream, _)) => {
                    stream.set_nonblocking(false).map_err(|e| e.to_string())?;
                    stream.set_read_timeout(Some(Duration::from_secs(5))).ok();
                    let mut hello = [0u8; 16];
                    stream.read_exact(&mut hello).map_err(|e| format!("a greeting: {e}"))?;
                    let magic = u64::from_le_bytes(hello[..8].try_into().expect("8 bytes"));
                    let peer = u64::from_le_bytes(hello[8..].try_into().expect("8 bytes")) as usize;
                    if magic != HELLO || !remote.contains(&peer) || peer > me {
                        return Err(format!("an unexpected connection (claims rank {peer})"));
                    }
                    links.push((peer, stream, false));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let have: Vec<usize> = links.iter().map(|l| l.0).collect();
                        let missing: Vec<usize> =
                            remote.iter().copied().filter(|p| !have.contains(p)).collect();
                        return Err(format!(
                            "ranks {missing:?} did not connect within {timeout:?} ({below} were due)"
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(format!("accepting a connection: {e}")),
            }
        }
        for (_, stream, _) in &links {
            stream.set_nonblocking(true).map_err(|e| e.to_string())?;
        }
        Ok(Liveness { links })
    }

    /// The peers whose connection ended since the last look, each with whether it said goodbye
    /// first. Never blocks.
    pub(crate) fn ended(&mut self) -> Vec<(usize, bool)> {
        let mut ended = Vec::new();
        if self.links.is_empty() {
            return ended;
        }
        let mut fds: Vec<PollFd<'_>> =
            self.links.iter().map(|(_, s, _)| PollFd::new(s, PollFlags::IN)).collect();
        let zero = rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 };
        let ready = rustix::event::poll(&mut fds, Some(&zero)).unwrap_or(0);
        if ready == 0 {
            return ended;
        }
        let hits: Vec<bool> = fds.iter().map(|f| !f.revents().is_empty()).collect();
        drop(fds);
        let mut keep = Vec::with_capacity(self.links.len());
        for ((peer, mut stream, mut bye), hit) in
            std::mem::take(&mut self.links).into_iter().zip(hits)
        {
            if !hit {
                keep.push((peer, stream, bye));
                continue;
            }
            let mut buf = [0u8; 16];
            match stream.read(&mut buf) {
                Ok(0) => ended.push((peer, bye)),
                Ok(k) => {
                    bye |= buf[..k].contains(&BYE);
                    keep.push((peer, stream, bye));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    keep.push((peer, stream, bye))
                }
                Err(_) => ended.push((peer, bye)),
            }
        }
        self.links = keep;
        ended
    }

    /// Tells every peer this process leaves in order.
    pub(crate) fn bye(&mut self) {
        for (_, stream, _) in &mut self.links {
            let _ = stream.write(&[BYE]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_pack_into_words() {
        let a = Address { host: "node-17.cluster".into(), port: 40123 };
        assert_eq!(Address::from_words(&a.to_words()), a);
    }

    #[test]
    fn an_end_without_goodbye_is_seen_and_one_with_it_is_told_apart() {
        let (l0, p0) = listen().unwrap();
        let (l1, p1) = listen().unwrap();
        let addresses = [
            Address { host: "localhost".into(), port: p0 },
            Address { host: "localhost".into(), port: p1 },
        ];
        let same = [true, true];
        let t = Duration::from_secs(5);
        let a = std::thread::spawn(move || Liveness::connect(0, l0, &addresses, &same, &[1], t));
        let addresses = [
            Address { host: "localhost".into(), port: p0 },
            Address { host: "localhost".into(), port: p1 },
        ];
        let mut b = Liveness::connect(1, l1, &addresses, &same, &[0], t).unwrap();
        let mut a = a.join().unwrap().unwrap();
        assert!(a.ended().is_empty() && b.ended().is_empty());
        b.bye();
        drop(b);
        let start = Instant::now();
        loop {
            let ended = a.ended();
            if !ended.is_empty() {
                assert_eq!(ended, vec![(1, true)]);
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(5), "the end was never seen");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
