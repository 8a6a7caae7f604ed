//! The NPU dispatch end to end, against the CANN stand-in (`tests/cann_stand_in/`): a world of
//! one rank per NPU is made with a context, a stream, an HCCL communicator and a SHMEM PE each;
//! ops compile their Ascend C kernel once (with the device's architecture), load it on every
//! device, pass their arguments in the kernel's order, launch on the right cores and
//! synchronise; vendor failures, compile logs and kernel timeouts come back as typed errors
//! naming the call; without SHMEM the tile kernels say so and the unfused baselines run; the
//! vendor's MC2 operators are called in their two phases.
//!
//! THE STAND-IN RUNS NO KERNEL AND COMPUTES NOTHING: these tests check the calls, not results.
//! Nothing here has run on an NPU.
//!
//! One stand-in set per test binary (the stand-ins find each other through the process's global
//! symbols), shared by the tests, which therefore run one at a time and reset it first.
#![cfg(target_os = "linux")]

mod cann_stand_in;

use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use cann_stand_in::{CannStandIn, Variant};
use dist_tensor::device::ascend::{
    Ascend, AscendWorldBuilder, KernelSource, PathTaken, last_path, vendor,
};
use dist_tensor::{DistTensor, Error, Placement, Result, Tensor, World, collectives, fused};
use half::{bf16, f16};

static SERIAL: Mutex<()> = Mutex::new(());
static STAND_IN: OnceLock<CannStandIn> = OnceLock::new();

/// The shared stand-in, reset, with 8 devices of a 910B's core counts; held while a test runs.
fn stand_in() -> (MutexGuard<'static, ()>, &'static CannStandIn) {
    let guard = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let cann = STAND_IN
        .get_or_init(|| CannStandIn::build(&cann_stand_in::scratch_dir("dispatch"), Variant::Full));
    cann.acl.reset();
    cann.acl.set_device_count(8);
    cann.shmem_process_global(false);
    (guard, cann)
}

fn runtime(cann: &CannStandIn) -> Result<Ascend> {
    // SAFETY: the stand-in exports the AscendCL symbols with the headers' C signatures.
    unsafe { Ascend::open_path(&cann.acl.path) }
}

fn builder(cann: &CannStandIn, ranks: u32) -> Result<AscendWorldBuilder> {
    let devices: Vec<u32> = (0..ranks).collect();
    Ok(AscendWorldBuilder::new(&devices)
        .runtime(runtime(cann)?)
        .heap_bytes(16 << 20)
        .wait_timeout(Duration::from_secs(5)))
}

fn world(cann: &CannStandIn, ranks: u32) -> Result<World> {
    builder(cann, ranks)?.build()
}

/// The log lines that start with `prefix`.
fn lines(log: &[String], prefix: &str) -> Vec<String> {
    log.iter().filter(|l| l.starts_with(prefix)).cloned().collect()
}

/// The position of the first line starting with `prefix` at or after `from`.
fn find(log: &[String], from: usize, prefix: &str) -> usize {
    log[from..]
        .iter()
        .position(|l| l.starts_with(prefix))
        .map(|i| from + i)
        .unwrap_or_else(|| panic!("no `{prefix}` after line {from} in {log:#?}"))
}

/// The typed error of the rank that failed first, from a run that failed (an error after
/// every rank agreed to a call fails the world, so that no peer waits for the failed rank).
fn failure<R: std::fmt::Debug>(run: Result<R>) -> Error {
    run.expect_err("the run fails").rank_error().clone()
}

/// A launch line's arguments, as the stand-in recorded them (signed 64-bit values).
fn launch_args(line: &str) -> Vec<i64> {
    let args = line.split("args=").nth(1).expect("args").trim_end_matches(')');
    args.split(':').map(|v| v.parse().expect("an integer")).collect()
}

/// The value of `kernel`'s parameter `name` in a launch line.
fn arg(kernel: &str, line: &str, name: &str) -> i64 {
    let source = KernelSource::all().iter().find(|k| k.name() == kernel).expect("a kernel");
    let index = source.params().iter().position(|(n, _)| n == name).expect("a parameter");
    launch_args(line)[index]
}

/// Every test of this file, named `ascend::*` so that `cargo test ascend` selects them.
mod ascend {
    use super::*;

    #[test]
    fn world_ascend_makes_a_context_stream_communicator_and_pe_per_npu() -> Result<()> {
        let (_serial, cann) = stand_in();
        {
            let world = world(cann, 2)?;
            assert_eq!(world.num_ranks(), 2);
            assert_eq!((world.topology().aicore_num(), world.topology().sub_vec_num()), (24, 2));
            let log = cann.acl.log();
            let created = find(&log, 0, "aclrtCreateContext(0)");
            let stream0 = find(&log, created, "aclrtCreateStream(dev=0)");
            let created1 = find(&log, stream0, "aclrtCreateContext(1)");
            find(&log, created1, "aclrtCreateStream(dev=1)");
            let comms = find(&log, created1, "HcclCommInitAll(2 devices)");
            let uid = find(&log, comms, "aclshmemx_get_uniqueid(dev=0)");
            let mut inits = lines(&log[uid..], "aclshmemx_init_attr");
            inits.sort();
            assert_eq!(
                inits,
                [
                    "aclshmemx_init_attr(dev=0,pe=0,n=2,16777216 bytes)",
                    "aclshmemx_init_attr(dev=1,pe=1,n=2,16777216 bytes)"
                ]
            );
            // Every PE checked that it reaches every peer's heap.
            assert_eq!(lines(&log, "aclshmem_ptr(").len(), 4, "{log:#?}");
            assert!(lines(&log, "aclshmem_ptr(").iter().all(|l| l.ends_with("->ok")));
            let ranks = world.run(|rank| Ok(rank.rank()))?;
            assert_eq!(ranks, vec![0, 1]);
        }
        // Dropped: every PE left SHMEM, every communicator, stream and context is gone.
        let log = cann.acl.log();
        let mut finals = lines(&log, "aclshmem_finalize");
        finals.sort();
        assert_eq!(finals, ["aclshmem_finalize(pe=0)", "aclshmem_finalize(pe=1)"]);
        assert_eq!(lines(&log, "HcclCommDestroy").len(), 2);
        assert_eq!(lines(&log, "aclrtDestroyStream").len(), 2);
        assert_eq!(lines(&log, "aclrtDestroyContext").len(), 2);
        assert_eq!(log.last().map(String::as_str), Some("aclFinalize"));
        Ok(())
    }

    #[test]
    fn all_gather_matmul_compiles_once_loads_on_each_device_and_launches_with_its_arguments()
    -> Result<()> {
        let (_serial, cann) = stand_in();
        let world = world(cann, 2)?;
        let (m_r, k, n) = (5, 300, 7);
        let paths = world.run(|rank| {
            let x = Tensor::<f16>::random(&[m_r + rank.rank(), k], rank.rank() as u64);
            let w = Tensor::<f16>::random(&[k, n], 9);
            let out = fused::all_gather_matmul(rank, x.view2("x")?, &[w.view2("w")?])?;
            assert_eq!(out.outputs[0].shape(), [2 * m_r + 1, n]);
            assert_eq!(out.row_counts, [m_r, m_r + 1]);
            let first = last_path(rank);
            // A second call: nothing is compiled or loaded again.
            fused::all_gather_matmul(rank, x.view2("x")?, &[w.view2("w")?])?;
            Ok(first)
        })?;
        assert_eq!(paths, vec![Some(PathTaken::Kernel("all_gather_matmul")); 2]);

        let log = cann.acl.log();
        // Compiled once for the world, for the device's architecture and the element type.
        assert_eq!(lines(&log, "aclrtcCreateProg(").len(), 1, "{log:#?}");
        let create = find(&log, 0, "aclrtcCreateProg(all_gather_matmul,");
        let compile = find(
            &log,
            create,
            "aclrtcCompileProg(all_gather_matmul,--npu-arch=dav-2201,-std=c++17,-DDT_ELEM=half",
        );
        let size = find(&log, compile, "aclrtcGetBinDataSize(all_gather_matmul)");
        let data = find(&log, size, "aclrtcGetBinData(all_gather_matmul)");
        find(&log, data, "aclrtcDestroyProg(all_gather_matmul)");
        // Loaded once per device, as an AI-core ELF; its entry point found by name.
        let loads = lines(&log, "aclrtBinaryLoadFromData");
        assert_eq!(loads.len(), 2);
        assert!(loads.iter().all(|l| l.ends_with("magic=0x43554245)")), "{loads:?}");
        for dev in 0..2 {
            let load = find(&log, 0, &format!("aclrtBinaryLoadFromData(dev={dev},"));
            let func =
                find(&log, load, &format!("aclrtBinaryGetFunction(dev={dev},all_gather_matmul)"));
            let init =
                find(&log, func, &format!("aclrtKernelArgsInit(dev={dev},all_gather_matmul)"));
            let params = KernelSource::all()[0].params().len();
            let fin = find(
                &log,
                init,
                &format!("aclrtKernelArgsFinalize(dev={dev},all_gather_matmul,{params} args)"),
            );
            let launch = find(
                &log,
                fin,
                &format!("aclrtLaunchKernelWithConfig(dev={dev},all_gather_matmul,blocks=24,"),
            );
            let sync = find(
                &log,
                launch,
                &format!("aclrtSynchronizeStreamWithTimeout(dev={dev},timeout)"),
            );
            find(&log, sync, &format!("aclrtMemcpy(dev={dev},D2H,{}", (2 * m_r + 1) * n * 2));
            let line = &log[launch];
            assert_eq!(launch_args(line).len(), params);
            assert_eq!(arg("all_gather_matmul", line, "rank"), dev);
            assert_eq!(arg("all_gather_matmul", line, "num_ranks"), 2);
            assert_eq!(arg("all_gather_matmul", line, "k"), k as i64);
            assert_eq!(arg("all_gather_matmul", line, "n"), n as i64);
            assert_eq!(arg("all_gather_matmul", line, "push"), 1);
            assert!(arg("all_gather_matmul", line, "timeout_cycles") > 0);
        }
        assert_eq!(lines(&log, "aclrtLaunchKernelWithConfig").len(), 4);
        assert_eq!(lines(&log, "aclrtBinaryLoadFromData").len(), 2, "loaded once per device");
        // The gathered rows in symmetric memory: the same size, at the same offset, on both PEs.
        let gathered = (2 * m_r + 1) * k * 2;
        let mut allocs = lines(&log, &format!("aclshmem_malloc(pe=0,{gathered})"));
        allocs.extend(lines(&log, &format!("aclshmem_malloc(pe=1,{gathered})")));
        assert_eq!(allocs.len(), 2, "{log:#?}");
        let offset = |l: &String| l.rsplit("->").next().unwrap().to_string();
        assert_eq!(offset(&allocs[0]), offset(&allocs[1]));
        Ok(())
    }

    #[test]
    fn each_fused_op_and_collective_launches_its_kernel_on_the_right_cores() -> Result<()> {
        let (_serial, cann) = stand_in();
        let world = world(cann, 3)?;
        let paths = world.run(|rank| {
            let r = rank.rank();
            let mut paths = Vec::new();
            let x = Tensor::<f32>::random(&[4, 6], r as u64);
            let w = Tensor::<f32>::random(&[6, 5], 7);
            fused::matmul_reduce_scatter(rank, x.view2("x")?, w.view2("w")?)?;
            paths.push(last_path(rank));
            let q = Tensor::<bf16>::random(&[1, 2 + r, 3, 4], r as u64);
            fused::all_to_all(rank, &q, 2, 1)?;
            paths.push(last_path(rank));
            collectives::all_gather(rank, &vec![1.0f32; r + 1])?;
            paths.push(last_path(rank));
            collectives::reduce_scatter(rank, &[1.0f32; 7], collectives::ReduceOp::Sum)?;
            paths.push(last_path(rank));
            collectives::all_to_all_v(rank, &[2.0f32; 6], &[1, 2, 3])?;
            paths.push(last_path(rank));
            collectives::broadcast(rank, &[3.0f32; 5], 2)?;
            paths.push(last_path(rank));
            Ok(paths)
        })?;
        let kernels = [
            "matmul_reduce_scatter",
            "all_to_all",
            "all_gather",
            "reduce_scatter",
            "all_to_all_v",
            "broadcast",
        ];
        for rank_paths in &paths {
            let expected: Vec<_> = kernels.iter().map(|k| Some(PathTaken::Kernel(k))).collect();
            assert_eq!(rank_paths, &expected);
        }
        let log = cann.acl.log();
        for kernel in kernels {
            let source = KernelSource::all().iter().find(|k| k.name() == kernel).unwrap();
            // Mix kernels on the AI cores, vector-only ones on the vector cores: counts from the
            // device (24 x 2), never constants.
            let blocks = if source.mix() { 24 } else { 48 };
            let launches = lines(&log, &format!("aclrtLaunchKernelWithConfig(dev=0,{kernel},"));
            assert_eq!(launches.len(), 1, "{kernel}: {launches:?}");
            assert!(launches[0].contains(&format!(",blocks={blocks},")), "{}", launches[0]);
            assert_eq!(launch_args(&launches[0]).len(), source.params().len(), "{kernel}");
            assert_eq!(arg(kernel, &launches[0], "num_ranks"), 3);
        }
        // The element type of each build: f32 for the collectives here, bf16 for the all_to_all.
        assert_eq!(lines(&log, "aclrtcCompileProg(all_to_all,").len(), 1);
        assert!(lines(&log, "aclrtcCompileProg(all_to_all,")[0].contains("-DDT_ELEM=bfloat16_t"));
        assert!(lines(&log, "aclrtcCompileProg(broadcast,")[0].contains("-DDT_ELEM=float"));
        // The broadcast's root, and the reduce_scatter's sum (not mean).
        let bcast = &lines(&log, "aclrtLaunchKernelWithConfig(dev=1,broadcast,")[0];
        assert_eq!(arg("broadcast", bcast, "root"), 2);
        let rs = &lines(&log, "aclrtLaunchKernelWithConfig(dev=1,reduce_scatter,")[0];
        assert_eq!(arg("reduce_scatter", rs, "mean"), 0);
        Ok(())
    }

    #[test]
    fn dist_tensor_methods_run_unchanged_on_an_ascend_world() -> Result<()> {
        let (_serial, cann) = stand_in();
        let world = world(cann, 2)?;
        let x = Tensor::<f16>::random(&[6, 8], 1);
        let w1 = Tensor::<f16>::random(&[8, 4], 2);
        let w2 = Tensor::<f16>::random(&[4, 8], 3);
        let paths = world.run(|rank| {
            let x = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
            let w1 = DistTensor::from_global(rank, &w1, Placement::Shard(1))?;
            let w2 = DistTensor::from_global(rank, &w2, Placement::Shard(0))?;
            let h = x.all_gather_matmul(w1.local())?;
            let first = last_path(rank);
            let y = h.matmul_reduce_scatter(w2.local())?;
            assert_eq!(y.local().shape(), [3, 8]);
            Ok((first, last_path(rank)))
        })?;
        for (first, second) in paths {
            assert_eq!(first, Some(PathTaken::Kernel("all_gather_matmul")));
            assert_eq!(second, Some(PathTaken::Kernel("matmul_reduce_scatter")));
        }
        Ok(())
    }

    #[test]
    fn f64_has_no_npu_kernel_and_every_rank_says_so() -> Result<()> {
        let (_serial, cann) = stand_in();
        let world = world(cann, 2)?;
        let errs = world.run(|rank| {
            let x = Tensor::<f64>::random(&[3, 4], 1);
            let w = Tensor::<f64>::random(&[4, 2], 2);
            Ok(fused::all_gather_matmul(rank, x.view2("x")?, &[w.view2("w")?]).unwrap_err())
        })?;
        // Every rank fails, naming the first rank with the problem; that rank says what it is.
        for err in &errs {
            assert!(
                matches!(err, Error::InvalidArgument { op: "all_gather_matmul", rank: 0, .. }),
                "{err}"
            );
        }
        assert!(errs[0].to_string().contains("f64 has no NPU kernel"), "{}", errs[0]);
        assert!(lines(&cann.acl.log(), "aclrtcCreateProg").is_empty(), "nothing was compiled");
        Ok(())
    }

    #[test]
    fn a_compile_error_comes_back_with_the_compilers_log() -> Result<()> {
        let (_serial, cann) = stand_in();
        let world = world(cann, 2)?;
        cann.acl.fail(
            "aclrtcCompileProg",
            176_003,
            "all_gather.cpp:57:13: error: use of undeclared identifier 'chunk_at'",
        );
        let err = failure(world.run(|rank| collectives::all_gather(rank, &[1.0f32, 2.0])));
        match &err {
            Error::KernelCompile { call, kernel, options, code, log } => {
                assert_eq!((*call, *kernel, *code), ("aclrtcCompileProg", "all_gather", 176_003));
                assert!(options.starts_with("--npu-arch=dav-2201"), "{options}");
                assert!(log.contains("use of undeclared identifier 'chunk_at'"), "{log}");
            }
            other => panic!("expected the compile error, got {other:?}"),
        }
        assert!(err.to_string().contains("compile log:\nall_gather.cpp:57:13"), "{err}");
        let log = cann.acl.log();
        // The log was fetched, the program destroyed, nothing launched.
        let compile = find(&log, 0, "aclrtcCompileProg(all_gather,");
        let size = find(&log, compile, "aclrtcGetCompileLogSize(all_gather)");
        let text = find(&log, size, "aclrtcGetCompileLog(all_gather)");
        find(&log, text, "aclrtcDestroyProg(all_gather)");
        assert!(lines(&log, "aclrtLaunchKernelWithConfig").is_empty());
        Ok(())
    }

    #[test]
    fn a_failing_launch_is_a_typed_error_with_the_vendors_message() -> Result<()> {
        let (_serial, cann) = stand_in();
        let world = world(cann, 2)?;
        cann.acl.fail(
            "aclrtLaunchKernelWithConfig",
            507_015,
            "EZ9999: aicore exception (stand-in)",
        );
        let err = failure(world.run(|rank| collectives::broadcast(rank, &[1.0f32; 3], 0)));
        assert!(
            matches!(err, Error::DeviceStatus { call: "aclrtLaunchKernelWithConfig", code: 507_015, ref message }
                if message.contains("EZ9999")),
            "{err}"
        );
        Ok(())
    }

    #[test]
    fn a_kernel_wait_that_timed_out_is_reported_with_its_signal() -> Result<()> {
        let (_serial, cann) = stand_in();
        let world = world(cann, 2)?;
        // Play a kernel whose program 3 gave up waiting for signal 1 (>= 96, saw 48).
        let record: Vec<u8> =
            [1i64, 3, 0, 1, 96, 48, 0, 0].iter().flat_map(|v| v.to_ne_bytes()).collect();
        let status_arg = KernelSource::all()
            .iter()
            .find(|k| k.name() == "all_gather")
            .unwrap()
            .params()
            .iter()
            .position(|(n, _)| n == "status")
            .unwrap();
        cann.acl.on_launch("all_gather", status_arg, &record);
        let err = failure(world.run(|rank| collectives::all_gather(rank, &[1.0f32])));
        match &err {
            Error::WaitTimeout { signal, awaited, seen, timeout, .. } => {
                assert_eq!((*signal, awaited.as_str(), *seen), (1, ">= 96", 48));
                assert_eq!(*timeout, Duration::from_secs(5));
            }
            other => panic!("expected a wait timeout, got {other:?}"),
        }
        assert!(err.to_string().contains("program 3 (sub_vec 0)"), "{err}");
        Ok(())
    }

    #[test]
    fn without_shmem_the_kernels_say_why_and_the_unfused_baselines_run() -> Result<()> {
        let (_serial, cann) = stand_in();
        let world = builder(cann, 2)?.without_shmem().build()?;
        assert!(lines(&cann.acl.log(), "aclshmemx_init_attr").is_empty());
        let x = |rank: &dist_tensor::Rank<'_>| Tensor::<bf16>::random(&[3, 8], rank.rank() as u64);
        let w = Tensor::<bf16>::random(&[8, 4], 5);
        let out = world.run(|rank| {
            let x = x(rank);
            let unfused = fused::all_gather_matmul_unfused(rank, x.view2("x")?, &[w.view2("w")?])?;
            assert_eq!(unfused.outputs[0].shape(), [6, 4]);
            let first = last_path(rank);
            fused::matmul_reduce_scatter_unfused(rank, x.view2("x")?, w.view2("w")?)?;
            Ok((first, last_path(rank)))
        })?;
        for (first, second) in out {
            assert_eq!(first, Some(PathTaken::Unfused("all_gather_matmul")));
            assert_eq!(second, Some(PathTaken::Unfused("matmul_reduce_scatter")));
        }
        let log = cann.acl.log();
        let gather = find(&log, 0, "HcclAllGatherV(rank=0,send=24,type=11,count0=24)");
        let prepare = find(&log, gather, "aclnnMatmulGetWorkspaceSize(cubeMathType=0)");
        let gemm = find(&log, prepare, "aclnnMatmul(workspace=256)");
        find(&log, gemm, "HcclReduceScatterV(rank=");
        // The tile kernel, though, needs the symmetric heap, and says so.
        let err = failure(world.run(|rank| {
            let x = x(rank);
            fused::all_gather_matmul(rank, x.view2("x")?, &[w.view2("w")?])
        }));
        assert!(matches!(err, Error::DeviceUnavailable { op: "all_gather_matmul", .. }), "{err}");
        assert!(err.to_string().contains("without_shmem"), "{err}");
        Ok(())
    }

    #[test]
    fn shmem_missing_from_disk_is_named_in_the_kernels_error() -> Result<()> {
        let (_serial, cann) = stand_in();
        let shmem = cann.dir.join("libshmem.so");
        let hidden = cann.dir.join("libshmem.so.hidden");
        std::fs::rename(&shmem, &hidden).expect("hide the SHMEM stand-in");
        let outcome = (|| -> Result<Error> {
            let world = world(cann, 2)?;
            Ok(failure(world.run(|rank| collectives::all_gather(rank, &[1.0f32]))))
        })();
        std::fs::rename(&hidden, &shmem).expect("restore the SHMEM stand-in");
        let err = outcome?;
        let text = err.to_string();
        assert!(matches!(err, Error::DeviceUnavailable { op: "all_gather", .. }), "{err}");
        assert!(text.contains("Ascend SHMEM (libshmem.so) not found"), "{text}");
        assert!(text.contains(&format!("{} (no such file)", shmem.display())), "{text}");
        Ok(())
    }

    #[test]
    fn a_shmem_that_keeps_one_pe_per_process_is_refused_not_trusted() -> Result<()> {
        let (_serial, cann) = stand_in();
        cann.shmem_process_global(true);
        let err = world(cann, 2).unwrap_err();
        cann.shmem_process_global(false);
        assert!(matches!(err, Error::DeviceUnavailable { op: "World::ascend", .. }), "{err}");
        assert!(err.to_string().contains("keeps one PE per process"), "{err}");
        // Nothing collective was attempted after the check failed.
        assert!(lines(&cann.acl.log(), "aclshmem_malloc").is_empty());
        Ok(())
    }

    #[test]
    fn bad_device_lists_are_refused() -> Result<()> {
        let (_serial, cann) = stand_in();
        let err = AscendWorldBuilder::new(&[1, 1]).runtime(runtime(cann)?).build().unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { op: "World::ascend", .. }), "{err}");
        let err = AscendWorldBuilder::new(&[0, 8]).runtime(runtime(cann)?).build().unwrap_err();
        assert!(matches!(err, Error::DeviceUnavailable { op: "Ascend::device", .. }), "{err}");
        Ok(())
    }

    #[test]
    fn a_soc_of_unknown_architecture_asks_for_the_override() -> Result<()> {
        let (_serial, cann) = stand_in();
        cann.acl.set_soc_name("Ascend310P3");
        let world = world(cann, 1)?;
        let err = failure(world.run(|rank| collectives::all_gather(rank, &[1.0f32])));
        assert!(err.to_string().contains("DIST_TENSOR_NPU_ARCH"), "{err}");
        assert!(err.to_string().contains("Ascend310P3"), "{err}");
        Ok(())
    }

    #[test]
    fn vendor_mc2_operators_are_called_in_two_phases_and_reported_as_the_vendors() -> Result<()> {
        let (_serial, cann) = stand_in();
        let world = world(cann, 2)?;
        let paths = world.run(|rank| {
            let x = Tensor::<f16>::random(&[4, 256], rank.rank() as u64);
            let w = Tensor::<f16>::random(&[256, 8], 3);
            let out = vendor::all_gather_matmul(rank, x.view2("x")?, w.view2("w")?)?;
            assert_eq!(out.shape(), [8, 8]);
            let first = last_path(rank);
            let mine = vendor::matmul_reduce_scatter(rank, x.view2("x")?, w.view2("w")?)?;
            assert_eq!(mine.shape(), [2, 8]);
            Ok((first, last_path(rank)))
        })?;
        for (first, second) in paths {
            assert_eq!(first, Some(PathTaken::Vendor("aclnnAllGatherMatmul")));
            assert_eq!(second, Some(PathTaken::Vendor("aclnnMatmulReduceScatter")));
        }
        let log = cann.acl.log();
        let get = find(
            &log,
            0,
            "aclnnAllGatherMatmulGetWorkspaceSize(group=standin_comm_2_ranks,gatherIndex=0,commTurn=0,streamMode=1,bias=none)",
        );
        let run = find(&log, get, "aclnnAllGatherMatmul(workspace=1024)");
        find(&log, run, "aclrtSynchronizeStreamWithTimeout(");
        let get = find(
            &log,
            run,
            "aclnnMatmulReduceScatterGetWorkspaceSize(group=standin_comm_2_ranks,reduceOp=sum,commTurn=0,streamMode=1,bias=none)",
        );
        find(&log, get, "aclnnMatmulReduceScatter(workspace=1024)");
        // No crate kernel ran: the comparison path is the vendor's alone.
        assert!(lines(&log, "aclrtLaunchKernelWithConfig").is_empty());
        Ok(())
    }

    #[test]
    fn vendor_limits_fail_every_rank_before_any_vendor_call() -> Result<()> {
        let (_serial, cann) = stand_in();
        let world = world(cann, 2)?;
        let errs = world.run(|rank| {
            let narrow_k = Tensor::<f16>::random(&[4, 128], 1);
            let w = Tensor::<f16>::random(&[128, 8], 2);
            let k_err =
                vendor::all_gather_matmul(rank, narrow_k.view2("x")?, w.view2("w")?).unwrap_err();
            let x32 = Tensor::<f32>::random(&[4, 256], 1);
            let w32 = Tensor::<f32>::random(&[256, 8], 2);
            let type_err =
                vendor::matmul_reduce_scatter(rank, x32.view2("x")?, w32.view2("w")?).unwrap_err();
            let odd = Tensor::<f16>::random(&[3, 256], 1);
            let w16 = Tensor::<f16>::random(&[256, 8], 2);
            let m_err =
                vendor::matmul_reduce_scatter(rank, odd.view2("x")?, w16.view2("w")?).unwrap_err();
            Ok((k_err.to_string(), type_err.to_string(), m_err.to_string()))
        })?;
        // Every rank fails each call; rank 0 (the first with the problem) says what it is.
        let (k_err, type_err, m_err) = &errs[0];
        assert!(k_err.contains("K = 128 is outside [256, 65535)"), "{k_err}");
        assert!(type_err.contains("f32 is not f16 or bf16"), "{type_err}");
        assert!(m_err.contains("M = 3 is not a multiple of the 2 ranks"), "{m_err}");
        let (k_err, type_err, _) = &errs[1];
        assert!(k_err.contains("rank 0") && k_err.contains("K = 128"), "{k_err}");
        assert!(type_err.contains("rank 0") && type_err.contains("f32"), "{type_err}");
        assert!(lines(&cann.acl.log(), "aclnn").is_empty(), "no vendor call was made");
        Ok(())
    }

    #[test]
    fn a_vendor_operator_refusal_comes_back_with_its_message() -> Result<()> {
        let (_serial, cann) = stand_in();
        let world = world(cann, 2)?;
        cann.acl.fail(
            "aclnnAllGatherMatmulGetWorkspaceSize",
            561_103,
            "EI0006: HCCL link not ready (stand-in)",
        );
        let errs = world.run(|rank| {
            let x = Tensor::<bf16>::random(&[4, 512], 1);
            let w = Tensor::<bf16>::random(&[512, 8], 2);
            Ok(vendor::all_gather_matmul(rank, x.view2("x")?, w.view2("w")?).unwrap_err())
        })?;
        for err in errs {
            assert!(
                matches!(err, Error::DeviceStatus { call: "aclnnAllGatherMatmulGetWorkspaceSize", code: 561_103, ref message }
                    if message.contains("EI0006")),
                "{err}"
            );
        }
        Ok(())
    }

    #[test]
    fn a_failing_vendor_call_while_making_the_world_is_named() -> Result<()> {
        let (_serial, cann) = stand_in();
        cann.acl.fail("aclshmemx_init_attr", -6, "unused");
        let err = world(cann, 2).unwrap_err();
        assert!(
            matches!(err, Error::DeviceStatus { call: "aclshmemx_init_attr", code: -6, ref message }
                if message.contains("ACLSHMEM_BOOTSTRAP_ERROR")),
            "{err}"
        );
        cann.acl.reset();
        cann.acl.set_device_count(8);
        cann.acl.fail("aclrtCreateStream", 107_000, "EE1020: out of streams (stand-in)");
        let err = world(cann, 2).unwrap_err();
        assert!(
            err.to_string().contains("aclrtCreateStream failed with status 107000: EE1020"),
            "{err}"
        );
        Ok(())
    }
}
