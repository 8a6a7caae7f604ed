//! 09: training a small GPT, tensor- and sequence-parallel (and data-parallel on a mesh), with
//! the one training stack: [`Trainer`] does the backward pass, gradient accumulation, the
//! replicas' averaging, clipping, the schedule, loss scaling and the optimizer's step, and saves
//! and resumes the whole state on any world size.
//!
//! The model ([`Gpt`]): token and position embeddings (the token table vocab-parallel), 2
//! pre-norm blocks of causal self-attention (4 heads) and a GELU MLP, a final RMS norm and a
//! vocab-parallel head; the loss is [`vocab_parallel_cross_entropy`], which never gathers the
//! logits. Activations between layers are sharded by tokens; attention runs with its heads split
//! over the ranks or (Ulysses) with tokens traded for heads by `all_to_all`.
//!
//! The task needs no download: reverse a sequence. Each example is 6 random digits, a
//! separator, then the 6 digits reversed; the model is scored on the 6 reversed digits. Guessing
//! gives ln 10 = 2.30; by default the example trains until the loss is below 0.05 and fails if
//! it is not by the last step, after checking its first steps against the same model trained
//! on one rank in f64 (both attention forms; within 1e-4 of the first loss in f32).
//!
//! Run: `cargo run --release --example 09_train_gpt -- [options]`
//!
//! - `--ranks N` (threads, 4 by default) or `--processes N`; `--mesh TPxDP` splits them into
//!   `DP` data-parallel replicas of `TP` tensor-parallel ranks (ZeRO-1 shards Adam's state over
//!   the replicas; each replica takes its share of the batch);
//! - `--steps N` (150), `--total N` (the schedule's length, `--steps` by default: a run saved
//!   at step k and resumed gives the same rates), `--schedule cosine|linear|constant`,
//!   `--clip X` (1.0), `--accumulate K` (micro-batches per step, 1);
//! - `--precision f32|bf16|f16`: in bf16 or f16 (f32 master weights in the optimizer; f16 with
//!   loss scaling) the same run is also made in f32 and both final losses printed, with their
//!   difference (the check: within 2%);
//! - `--save DIR` saves the training state after the steps; `--resume DIR` loads one (saved by
//!   any world and mesh), trains `--steps` more, then trains the unbroken run on this world and
//!   prints both curves (the check: within 1e-4 of the first loss; bitwise on the saving mesh);
//! - `--out DIR` (`target/09_train_gpt`): the loss curve as `loss.csv` and `loss.svg`;
//! - `--bench N` times N training steps instead (f32, heads split over the ranks).
//!
//! A progress bar on rank 0 shows the loss, tokens per second and the time left.

#[path = "common/device.rs"]
mod device;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dist_tensor::autograd::vocab_parallel_cross_entropy;
use dist_tensor::mesh::zero::Zero1;
use dist_tensor::mesh::{DataParallel, DeviceMesh};
use dist_tensor::nn::gpt::{AttentionForm, Gpt, GptConfig};
use dist_tensor::nn::{
    Adam, Constant, LossScaler, LrSchedule, Optimizer, WarmupCosine, WarmupLinear,
};
use dist_tensor::train::Trainer;
use dist_tensor::{Element, Error, Rank, World};
use indicatif::{ProgressBar, ProgressStyle};
use rand::{Rng, SeedableRng, rngs::StdRng};

const DIGITS: usize = 6;
const SEP: usize = 10;
const BATCH: usize = 8;
const COMPARE: usize = 8;
const THRESHOLD: f64 = 0.05;

const CONFIG: GptConfig =
    GptConfig { vocab: 11, embed: 32, heads: 4, hidden: 64, layers: 2, seq_len: 2 * DIGITS };

/// What a run does (from the arguments).
#[derive(Clone, Debug)]
struct Options {
    steps: usize,
    total: usize,
    schedule: String,
    clip: f64,
    accumulate: usize,
    precision: String,
    tp: usize,
    dp: usize,
    save: Option<PathBuf>,
    resume: Option<PathBuf>,
    out: PathBuf,
    bench: Option<usize>,
}

/// The ids and targets of step `step`'s batch: `BATCH` sequences of `2 DIGITS` tokens read, the
/// next token the target where it is a reversed digit.
fn batch(step: usize) -> Vec<(Vec<usize>, Vec<Option<usize>>)> {
    let mut rng = StdRng::seed_from_u64(1000 + step as u64);
    (0..BATCH)
        .map(|_| {
            let digits: Vec<usize> = (0..DIGITS).map(|_| rng.random_range(0..10)).collect();
            let mut seq = digits.clone();
            seq.push(SEP);
            seq.extend(digits.iter().rev());
            let targets = (1..=2 * DIGITS).map(|i| (i > DIGITS).then_some(seq[i])).collect();
            (seq[..2 * DIGITS].to_vec(), targets)
        })
        .collect()
}

fn schedule(o: &Options) -> Box<dyn LrSchedule> {
    let (peak, min, warmup, total) = (1e-2, 1e-3, 20.min(o.total / 4), o.total);
    match o.schedule.as_str() {
        "constant" => Box::new(Constant(peak)),
        "linear" => Box::new(WarmupLinear { peak, min, warmup, total }),
        _ => Box::new(WarmupCosine { peak, min, warmup, total }),
    }
}

/// What a run on one rank gave: its first step's number, each step's loss (the same on every
/// rank) and seconds.
#[derive(Clone, Debug, PartialEq)]
struct Run {
    from: usize,
    curve: Vec<f64>,
    seconds: Vec<f64>,
    /// Steps the loss scaler skipped (f16).
    skipped: usize,
}

/// `steps` steps of the run `o` on this rank (from 0, or from the checkpoint `resume`), saving
/// into `save` after.
fn train<T: Element>(
    rank: &Rank<'_>,
    o: &Options,
    form: AttentionForm,
    steps: usize,
    resume: Option<&Path>,
    save: Option<&Path>,
    bar: Option<&ProgressBar>,
) -> Result<Run, Error> {
    let mesh = DeviceMesh::new(rank, &[("dp", o.dp), ("tp", o.tp)])?;
    let tpr = mesh.rank_of("tp")?;
    let replica = mesh.coord("dp")?;
    let mut model = Gpt::<T>::new(&tpr, CONFIG, form, 7)?;
    let adam = Adam::new(1e-2);
    let optimizer: Box<dyn Optimizer<T> + '_> =
        if o.dp > 1 { Box::new(Zero1::new(adam, mesh.averager("dp")?)) } else { Box::new(adam) };
    let mut trainer = Trainer::new(optimizer)
        .schedule(schedule(o))
        .clip_grad_norm(o.clip)
        .accumulate(o.accumulate)
        .data_parallel(DataParallel::new(mesh.averager("dp")?));
    if T::DTYPE == dist_tensor::DType::F16 {
        trainer = trainer.loss_scaling(LossScaler::new(65536.0));
    }
    if let Some(dir) = resume {
        trainer.resume(&tpr, dir, &mut model)?;
    }
    let from = trainer.steps();
    let per = BATCH / o.dp;
    let start = Instant::now();
    let mut curve = Vec::with_capacity(steps);
    let mut seconds = Vec::with_capacity(steps);
    let mut skipped = 0;
    for step in from..from + steps {
        let begun = Instant::now();
        let share: Vec<_> = batch(step).into_iter().skip(replica * per).take(per).collect();
        for micro in share.chunks(per.div_ceil(o.accumulate)) {
            let ids: Vec<usize> = micro.iter().flat_map(|(i, _)| i.clone()).collect();
            let targets: Vec<Option<usize>> = micro.iter().flat_map(|(_, t)| t.clone()).collect();
            let loss = vocab_parallel_cross_entropy(&model.forward(&tpr, &ids)?, &targets)?;
            if let Some(report) = trainer.step(&loss, &mut model, &tpr)? {
                curve.push(report.loss);
                seconds.push(begun.elapsed().as_secs_f64());
                skipped += usize::from(report.skipped);
                if let Some(bar) = bar {
                    let tokens = (curve.len() * BATCH * CONFIG.seq_len) as f64;
                    let rate = tokens / start.elapsed().as_secs_f64().max(1e-9);
                    bar.set_message(format!("loss {:.4}  {rate:.0} tokens/s", report.loss));
                    bar.inc(1);
                }
            }
        }
    }
    if let Some(dir) = save {
        trainer.save(&tpr, dir, &model)?;
    }
    Ok(Run { from, curve, seconds, skipped })
}

/// A progress bar on the rank that prints (rank 0): hidden when standard error is no terminal.
fn progress(lead: bool, steps: usize, what: &str) -> Option<ProgressBar> {
    lead.then(|| {
        let bar = ProgressBar::new(steps as u64);
        let style =
            ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} steps  {msg}  ETA {eta}")
                .expect("a valid template")
                .progress_chars("=> ");
        bar.set_style(style);
        bar.set_prefix(what.to_string());
        bar.enable_steady_tick(Duration::from_millis(200));
        bar
    })
}

/// Rank 0's run on `world` (every rank's curve must be the same).
fn run_on<T: Element>(
    world: &World,
    o: &Options,
    form: AttentionForm,
    steps: usize,
    resume: Option<&Path>,
    save: Option<&Path>,
    what: &str,
) -> Result<Run, Error> {
    let lead = world.ranks_here().contains(&0);
    let bar = progress(lead, steps, what);
    let runs = world.run(|rank| {
        let bar = if rank.rank() == 0 { bar.as_ref() } else { None };
        train::<T>(rank, o, form, steps, resume, save, bar)
    })?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let Some(first) = runs.first().cloned() else {
        return Ok(Run { from: 0, curve: Vec::new(), seconds: Vec::new(), skipped: 0 });
    };
    if runs.iter().any(|r| r.curve != first.curve) {
        return Err(Error::InvalidArgument {
            op: "09_train_gpt",
            rank: 0,
            reason: "the ranks report different losses".into(),
        });
    }
    Ok(first)
}

/// Writes `curves` (name, losses from step `from`) as a CSV and an SVG under `dir`; their paths.
fn write_curves(
    dir: &Path,
    from: usize,
    curves: &[(&str, &[f64])],
) -> std::io::Result<[PathBuf; 2]> {
    use plotters::prelude::*;
    std::fs::create_dir_all(dir)?;
    let (csv, svg) = (dir.join("loss.csv"), dir.join("loss.svg"));
    let mut text = String::from("step");
    for (name, _) in curves {
        text.push_str(&format!(",{name}"));
    }
    text.push('\n');
    let len = curves.iter().map(|(_, c)| c.len()).max().unwrap_or(0);
    for i in 0..len {
        text.push_str(&(from + i).to_string());
        for (_, c) in curves {
            text.push_str(&c.get(i).map_or(String::new(), |v| format!(",{v}")));
        }
        text.push('\n');
    }
    std::fs::write(&csv, text)?;
    let top = curves.iter().flat_map(|(_, c)| c.iter()).fold(0.0f64, |m, &v| m.max(v)) * 1.05;
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(&svg, (720, 420)).into_drawing_area();
        root.fill(&WHITE)?;
        let x = from as f64..(from + len.max(2) - 1) as f64;
        let mut chart = ChartBuilder::on(&root)
            .margin(20)
            .caption("09_train_gpt: loss per step", ("sans-serif", 20))
            .x_label_area_size(35)
            .y_label_area_size(50)
            .build_cartesian_2d(x, 0.0..top.max(1e-3))?;
        chart.configure_mesh().x_desc("step").y_desc("loss").draw()?;
        for (k, (name, c)) in curves.iter().enumerate() {
            let color = Palette99::pick(k).to_rgba();
            let points = c.iter().enumerate().map(|(i, &v)| ((from + i) as f64, v));
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(2)))?
                .label(*name)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color));
        }
        chart.configure_series_labels().border_style(BLACK).background_style(WHITE).draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok([csv, svg])
}

fn worst(got: &[f64], want: &[f64]) -> f64 {
    got.iter().zip(want).fold(0.0f64, |m, (g, w)| m.max((g - w).abs()))
}

/// The default run: both attention forms in f32, their first steps against one rank in f64.
fn check_against_f64(world: &World, o: &Options) -> Result<bool, Error> {
    let lead = world.ranks_here().contains(&0);
    let one = Options { tp: 1, dp: 1, ..o.clone() };
    let want = World::threads(1)?
        .run(|rank| {
            train::<f64>(rank, &one, AttentionForm::TensorParallel, COMPARE, None, None, None)
        })?
        .remove(0)
        .curve;
    // A run cut short for --save is checked against f64, not for having learned.
    let whole = o.steps >= o.total;
    let mut ok = true;
    for form in [AttentionForm::TensorParallel, AttentionForm::Ulysses] {
        let what = format!("{form:?}");
        let save = o.save.as_deref().filter(|_| form == AttentionForm::TensorParallel);
        let run = run_on::<f32>(world, o, form, o.steps, None, save, &what)?;
        if !lead {
            continue;
        }
        let (got, seconds): (&[f64], f64) = (&run.curve, run.seconds.iter().sum());
        let n = COMPARE.min(got.len());
        let off = worst(&got[..n], &want) / want[0];
        let last = got[o.steps - 1];
        ok &= off <= 1e-4 && (last < THRESHOLD || !whole);
        println!(
            "{form:?} on a {}x{} mesh (tp x dp), f32, {} steps in {seconds:.1} s (one rank, f64, \
             for the first {COMPARE}):",
            o.tp, o.dp, o.steps
        );
        for step in 0..n {
            println!("  step {step:3}: loss {:.6}   (one rank, f64: {:.6})", got[step], want[step]);
        }
        for step in (COMPARE..o.steps).filter(|s| s % 50 == 0 || *s == o.steps - 1) {
            println!("  step {step:3}: loss {:.6}", got[step]);
        }
        println!(
            "  largest difference from f64 over the first {COMPARE} steps: {off:.1e} of the first \
             loss (tolerance 1e-4); final loss {last:.4} (threshold {THRESHOLD}){}",
            if last < THRESHOLD || !whole { "" } else { ": NOT LEARNED" }
        );
        if let Some(dir) = save {
            println!("  saved after step {}: {}", o.steps - 1, dir.display());
        }
        if form == AttentionForm::TensorParallel {
            let [csv, svg] = write_curves(&o.out, 0, &[("f32", got)]).map_err(|e| {
                Error::InvalidArgument { op: "09_train_gpt", rank: 0, reason: e.to_string() }
            })?;
            println!("  loss curve: {} and {}", csv.display(), svg.display());
        }
    }
    Ok(ok)
}

/// `--precision bf16|f16`: the same run in that precision and in f32; the final losses.
fn compare_precision(world: &World, o: &Options) -> Result<bool, Error> {
    let form = AttentionForm::TensorParallel;
    let run = match o.precision.as_str() {
        "bf16" => run_on::<half::bf16>(world, o, form, o.steps, None, None, "bf16")?,
        _ => run_on::<half::f16>(world, o, form, o.steps, None, None, "f16")?,
    };
    let half = run.curve;
    let full = run_on::<f32>(world, o, form, o.steps, None, None, "f32")?.curve;
    if !world.ranks_here().contains(&0) {
        return Ok(true);
    }
    let (h, f) = (half[o.steps - 1], full[o.steps - 1]);
    let rel = (h - f).abs() / f;
    println!(
        "{} steps on a {}x{} mesh: final loss {} {h:.5}, f32 {f:.5}: {:.2}% apart (within 2%: {}); \
         steps skipped for an overflow: {}",
        o.steps,
        o.tp,
        o.dp,
        o.precision,
        100.0 * rel,
        rel <= 0.02,
        run.skipped
    );
    let [csv, svg] =
        write_curves(&o.out, 0, &[(o.precision.as_str(), &half), ("f32", &full)]).map_err(|e| {
            Error::InvalidArgument { op: "09_train_gpt", rank: 0, reason: e.to_string() }
        })?;
    println!("loss curves: {} and {}", csv.display(), svg.display());
    Ok(rel <= 0.02)
}

/// `--resume DIR`: `--steps` more steps from the checkpoint, then the unbroken run; both curves.
fn resume_and_compare(world: &World, o: &Options, dir: &Path) -> Result<bool, Error> {
    let form = AttentionForm::TensorParallel;
    let resumed = run_on::<f32>(world, o, form, o.steps, Some(dir), o.save.as_deref(), "resumed")?;
    let at = resumed.from;
    let unbroken = run_on::<f32>(world, o, form, at + o.steps, None, None, "unbroken")?.curve;
    if !world.ranks_here().contains(&0) {
        return Ok(true);
    }
    let resumed = resumed.curve;
    let tail = &unbroken[at..];
    let off = worst(&resumed, tail) / unbroken[0];
    println!(
        "resumed at step {at} on a {}x{} mesh (tp x dp) against the unbroken run on it:",
        o.tp, o.dp
    );
    for (i, (r, u)) in resumed.iter().zip(tail).enumerate() {
        println!("  step {:3}: resumed {r:.6}   unbroken {u:.6}", at + i);
    }
    let bitwise = resumed == tail;
    println!(
        "  largest difference {off:.1e} of the first loss (tolerance 1e-4){}",
        if bitwise { ", bitwise the same" } else { "" }
    );
    let [csv, svg] =
        write_curves(&o.out, at, &[("resumed", &resumed), ("unbroken", tail)]).map_err(|e| {
            Error::InvalidArgument { op: "09_train_gpt", rank: 0, reason: e.to_string() }
        })?;
    println!("  loss curves: {} and {}", csv.display(), svg.display());
    Ok(off <= 1e-4)
}

/// Times `steps` training steps (f32, heads split over the ranks) after 3 unmeasured ones.
fn bench(world: &World, o: &Options, steps: usize) -> Result<(), Error> {
    let run =
        run_on::<f32>(world, o, AttentionForm::TensorParallel, steps + 3, None, None, "bench")?;
    if world.ranks_here().contains(&0) {
        let mut t = run.seconds[3..].to_vec();
        t.sort_by(f64::total_cmp);
        println!(
            "gpt step (09's model, f32, {}x{} mesh, batch {BATCH} x {} tokens): median {:.3} \
             ms, fastest {:.3} ms over {steps} steps",
            o.tp,
            o.dp,
            CONFIG.seq_len,
            t[t.len() / 2] * 1e3,
            t[0] * 1e3
        );
    }
    Ok(())
}

fn usage(problem: &str) -> ! {
    eprintln!(
        "{problem}\nusage: 09_train_gpt [--ranks N | --processes N] [--mesh TPxDP] [--steps N] \
         [--total N] [--schedule cosine|linear|constant] [--clip X] [--accumulate K] \
         [--precision f32|bf16|f16] [--save DIR] [--resume DIR] [--out DIR] [--bench N]"
    );
    std::process::exit(2)
}

fn parse(args: &[String], ranks: usize) -> Options {
    let mut o = Options {
        steps: 150,
        total: 0,
        schedule: "cosine".into(),
        clip: 1.0,
        accumulate: 1,
        precision: "f32".into(),
        tp: ranks,
        dp: 1,
        save: None,
        resume: None,
        out: PathBuf::from("target/09_train_gpt"),
        bench: None,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| usage(&format!("{flag} takes a value")));
        let number = || {
            value.parse::<usize>().unwrap_or_else(|_| usage(&format!("{flag} {value}: a number")))
        };
        match flag.as_str() {
            "--steps" => o.steps = number(),
            "--total" => o.total = number(),
            "--accumulate" => o.accumulate = number().max(1),
            "--bench" => o.bench = Some(number().max(1)),
            "--clip" => o.clip = value.parse().unwrap_or_else(|_| usage("--clip takes a number")),
            "--schedule" if ["cosine", "linear", "constant"].contains(&value.as_str()) => {
                o.schedule = value.clone()
            }
            "--precision" if ["f32", "bf16", "f16"].contains(&value.as_str()) => {
                o.precision = value.clone()
            }
            "--save" => o.save = Some(PathBuf::from(value)),
            "--resume" => o.resume = Some(PathBuf::from(value)),
            "--out" => o.out = PathBuf::from(value),
            "--mesh" => {
                let dims: Vec<usize> = value.split('x').filter_map(|d| d.parse().ok()).collect();
                let [tp, dp] = dims[..] else { usage("--mesh takes TPxDP, as 2x2") };
                (o.tp, o.dp) = (tp, dp);
            }
            _ => usage(&format!("unknown option {flag} {value}")),
        }
    }
    if o.total == 0 {
        o.total = o.steps;
    }
    if o.tp * o.dp != ranks {
        usage(&format!("a {}x{} mesh is {} ranks; the world has {ranks}", o.tp, o.dp, o.tp * o.dp));
    }
    if o.dp == 0 || !BATCH.is_multiple_of(o.dp) || o.steps == 0 {
        usage(&format!("the batch of {BATCH} sequences must split over {} replicas", o.dp));
    }
    if !(BATCH / o.dp).is_multiple_of(o.accumulate) {
        usage(&format!(
            "a replica's {} sequences must split into {} micro-batches",
            BATCH / o.dp,
            o.accumulate
        ));
    }
    o
}

fn main() -> Result<(), Error> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let Some(world) = device::world_from_args(&mut args, 4)? else { return Ok(()) };
    let o = parse(&args, world.num_ranks());
    if let Some(n) = o.bench {
        return bench(&world, &o, n);
    }
    let ok = match (&o.resume, o.precision.as_str()) {
        (Some(dir), _) => resume_and_compare(&world, &o, dir)?,
        (None, "f32") => check_against_f64(&world, &o)?,
        (None, _) => compare_precision(&world, &o)?,
    };
    if !ok {
        eprintln!("the run did not pass its check (see above)");
        std::process::exit(1);
    }
    if world.ranks_here().contains(&0) {
        println!("ok");
    }
    Ok(())
}
