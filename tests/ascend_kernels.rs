//! The Ascend C kernel sources (`src/device/ascend/kernels/`), checked without an NPU:
//!
//! - every source is registered, embedded and has its launcher beside it;
//! - every source, as the crate hands it to `aclrtc` (headers pasted in), compiles with the host
//!   C++ compiler against a declared surface of Ascend C's API (`tests/cann_stand_in/ascendc/`),
//!   for every element type: this catches C++ errors and calls outside the declared surface, not
//!   what only CANN's compiler knows;
//! - every source follows the seed's conventions: masks, not padding; peers rotated by the rank;
//!   communication only on `sub_vec_id == 0` in mix kernels; grid-stride loops over flattened
//!   task spaces; core counts from the launch, never constants. Each check is also run on a
//!   deliberately wrong snippet, and must reject it.
//!
//! None of this has been compiled by CANN's compiler or run on an NPU.

use std::path::{Path, PathBuf};
use std::process::Command;

use dist_tensor::device::ascend::KernelSource;

fn kernels_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/device/ascend/kernels")
}

fn surface_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cann_stand_in/ascendc")
}

/// The source without `//` comments, line by line (line numbers kept).
fn code_lines(src: &str) -> Vec<String> {
    src.lines().map(|l| l.split("//").next().unwrap_or("").to_string()).collect()
}

/// The text of the call's arguments starting at byte `open` (just after `name(`), split at
/// top-level commas.
fn call_args(code: &str, open: usize) -> Vec<String> {
    let mut depth = 0;
    let mut args = vec![String::new()];
    for c in code[open..].chars() {
        match c {
            '(' => depth += 1,
            ')' if depth == 0 => break,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                args.push(String::new());
                continue;
            }
            _ => {}
        }
        args.last_mut().unwrap().push(c);
    }
    args.into_iter().map(|a| a.trim().to_string()).collect()
}

/// Every call of `name(` in the code (not its definitions): `(line number, arguments)`.
fn calls(src: &str, name: &str) -> Vec<(usize, Vec<String>)> {
    let mut found = Vec::new();
    for (i, line) in code_lines(src).iter().enumerate() {
        let pattern = format!("{name}(");
        let mut from = 0;
        while let Some(at) = line[from..].find(&pattern) {
            let start = from + at;
            let before = line[..start].chars().last();
            let is_call = !before.is_some_and(|c| c.is_alphanumeric() || c == '_');
            let is_definition = line.contains("inline") || line.contains("__aicore__");
            if is_call && !is_definition {
                found.push((i + 1, call_args(line, start + pattern.len())));
            }
            from = start + pattern.len();
        }
    }
    found
}

// ---- the checks ---------------------------------------------------------------------------

/// Masks, not padding: no DataCopyPad that pads (`isPad` true), nothing that fills a pad, and
/// every kernel cuts its ragged edges with `valid_len` (directly or through `chunk_at`).
fn check_masks_not_padding(name: &str, src: &str, kernel: bool) -> Result<(), String> {
    let code = code_lines(src).join("\n");
    let mut at = 0;
    while let Some(i) = code[at..].find("DataCopyPadExtParams<") {
        let start = at + i;
        let brace = code[start..].find('{').map(|b| start + b);
        let semi = code[start..].find(';').map(|s| start + s);
        if let (Some(brace), Some(semi)) = (brace, semi)
            && brace < semi
        {
            let first = code[brace + 1..].split(',').next().unwrap_or("").trim();
            if first != "false" {
                return Err(format!("{name}: a DataCopyPad pads ({{{first}, ...}}): mask instead"));
            }
        }
        at = start + 1;
    }
    for word in ["Duplicate(", "InitGlobalMemory(", "padded", "pad_to", "round_up", "ALIGN_UP"] {
        if code.contains(word) {
            return Err(format!("{name}: `{word}` pads a tile: mask instead"));
        }
    }
    if kernel && !code.contains("valid_len(") && !code.contains("chunk_at(") {
        return Err(format!("{name}: no masks (valid_len / chunk_at) at ragged edges"));
    }
    Ok(())
}

/// Whether `expr` is rotated by the rank: `(me + ...) % world`, or the prelude's
/// `locate_rotated` (checked on its own to rotate).
fn rotated(expr: &str) -> bool {
    (expr.contains("me +") && expr.contains("% world")) || expr.contains("locate_rotated(")
}

/// Whether identifier `ident` is assigned (anywhere in `src`) from a rotated expression.
fn assigned_rotated(src: &str, ident: &str) -> bool {
    code_lines(src).iter().any(|line| {
        let pattern = format!("{ident} = ");
        line.find(&pattern).is_some_and(|at| {
            let before = line[..at].chars().last();
            !before.is_some_and(|c| c.is_alphanumeric() || c == '_') && rotated(&line[at..])
        })
    })
}

/// Rank rotation: every peer a kernel reaches (`symm_at`'s rank, `notify_add`'s target,
/// `source`'s source) is `(me + i) % world`, so no peer is hit by every rank at once (a
/// broadcast's single source, `root`, aside).
fn check_rank_rotation(name: &str, src: &str) -> Result<(), String> {
    for (func, index) in [("symm_at", 1), ("notify_add", 2), ("source", 2)] {
        for (line, args) in calls(src, func) {
            let Some(peer) = args.get(index) else { continue };
            // A broadcast has one source, the root: there is no order of peers to rotate.
            if rotated(peer) || assigned_rotated(src, peer) || peer == "root" {
                continue;
            }
            return Err(format!(
                "{name}:{line}: {func} reaches rank `{peer}`, not rotated as (me + i) % world"
            ));
        }
    }
    Ok(())
}

/// The line ranges (1-based, inclusive) of the blocks that run on vector sub-core 0 only: an
/// `if (... sub == 0 ...) {` block, and everything after `if (sub != 0) { return; }`.
fn sub_vec_0_ranges(src: &str) -> Vec<(usize, usize)> {
    let lines = code_lines(src);
    let block_end = |from: usize| {
        let mut depth = 0i32;
        for (i, line) in lines.iter().enumerate().skip(from) {
            depth += line.matches('{').count() as i32 - line.matches('}').count() as i32;
            if depth <= 0 && i > from {
                return i + 1;
            }
            if depth <= 0 && line.contains('}') {
                return i + 1;
            }
        }
        lines.len()
    };
    let mut ranges = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if line.trim_start().starts_with("if (")
            && line.contains("sub == 0")
            && line.trim_end().ends_with('{')
        {
            ranges.push((i + 1, block_end(i)));
        }
        let next = lines.get(i + 1).map(|l| l.trim()).unwrap_or("");
        if line.trim() == "if (sub != 0) {" && next == "return;" {
            ranges.push((i + 1, lines.len()));
        }
    }
    ranges
}

/// Communication on sub-core 0: in a mix kernel, every `symm_at` and `notify_add` is in a block
/// that only vector sub-core 0 runs (the other sub-cores compute).
fn check_sub_vec_gating(name: &str, src: &str) -> Result<(), String> {
    if !src.contains("KERNEL_TYPE_MIX_AIC_1_2") {
        return Ok(()); // vector-only: every program is sub-core 0 of 1
    }
    let ranges = sub_vec_0_ranges(src);
    for func in ["symm_at", "notify_add"] {
        for (line, _) in calls(src, func) {
            if !ranges.iter().any(|&(a, b)| a <= line && line <= b) {
                return Err(format!("{name}:{line}: {func} outside a sub_vec_id == 0 section"));
            }
        }
    }
    Ok(())
}

/// A `for` loop header: `(variable, start, bound, step)` for `for (int64_t v = s; v < b; v += x)`.
fn stride_loops(src: &str) -> Vec<(usize, String, String, String, String)> {
    let mut loops = Vec::new();
    for (i, line) in code_lines(src).iter().enumerate() {
        let Some(at) = line.find("for (int64_t ") else { continue };
        let header = &line[at + "for (int64_t ".len()..];
        let parts: Vec<&str> = header.splitn(3, ';').collect();
        if parts.len() < 3 || !parts[2].contains("+=") {
            continue;
        }
        let (var, start) =
            parts[0].split_once('=').map(|(v, s)| (v.trim(), s.trim())).unwrap_or(("", ""));
        let bound = parts[1].split('<').nth(1).unwrap_or("").trim().to_string();
        let step = parts[2]
            .split("+=")
            .nth(1)
            .unwrap_or("")
            .trim()
            .trim_end_matches(['{', ' ', ')'])
            .to_string();
        loops.push((i + 1, var.to_string(), start.to_string(), bound, step));
    }
    loops
}

/// Grid-stride loops over flattened task spaces: each kernel walks at least one task count
/// grid-stride (starting at its program or lane, stepping by their number), and no loop moves
/// data with the cores shared out over the ranks alone (with two ranks, two cores would work).
fn check_grid_stride_flattened(name: &str, src: &str) -> Result<(), String> {
    let loops = stride_loops(src);
    let grid_stride = loops.iter().any(|(_, _, start, bound, step)| {
        ["pid", "lane"].contains(&start.as_str())
            && ["ncore", "lanes"].contains(&step.as_str())
            && !["world", "num_ranks"].contains(&bound.as_str())
    });
    if !grid_stride {
        return Err(format!("{name}: no grid-stride loop over a flattened task count"));
    }
    let lines = code_lines(src);
    for (line, _, start, bound, _) in &loops {
        if start == "pid" && (bound == "world" || bound == "num_ranks") {
            let body: String = lines[*line - 1..(*line + 8).min(lines.len())].join("\n");
            if body.contains("copy_2d(") || body.contains("symm_at(") {
                return Err(format!(
                    "{name}:{line}: data moves with cores shared over the ranks only"
                ));
            }
        }
    }
    Ok(())
}

/// Core counts from the launch: loops step by `ncore` or `lanes` (read from `num_programs()` /
/// `compute_lanes()`), never by a number, and no core count is written as a constant.
fn check_core_counts(name: &str, src: &str) -> Result<(), String> {
    for (line, _, _, _, step) in stride_loops(src) {
        if step.chars().next().is_some_and(|c| c.is_ascii_digit()) {
            return Err(format!(
                "{name}:{line}: a loop steps by the constant {step}: read the core count"
            ));
        }
    }
    let code = code_lines(src).join("\n");
    if code.contains("ncore =") && !code.contains("ncore = num_programs()") {
        return Err(format!("{name}: ncore is not num_programs()"));
    }
    for word in ["CORE_NUM", "AIV_NUM", "AIC_NUM", "BLOCK_DIM", "NUM_CORES"] {
        if code.contains(word) {
            return Err(format!("{name}: `{word}`: core counts are read from the device"));
        }
    }
    Ok(())
}

/// Every check, on one kernel source (with the headers it includes for the helpers' checks).
fn check_all(name: &str, src: &str) -> Result<(), String> {
    check_masks_not_padding(name, src, true)?;
    check_rank_rotation(name, src)?;
    check_sub_vec_gating(name, src)?;
    check_grid_stride_flattened(name, src)?;
    check_core_counts(name, src)
}

/// Every test of this file, named `ascend::*` so that `cargo test ascend` selects them.
mod ascend {
    use super::*;

    #[test]
    fn every_kernel_source_is_registered_embedded_and_has_its_launcher_beside_it() {
        let mut on_disk: Vec<String> = std::fs::read_dir(kernels_dir())
            .expect("the kernels directory")
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|f| f.ends_with(".cpp"))
            .collect();
        on_disk.sort();
        let mut registered: Vec<String> =
            KernelSource::all().iter().map(|k| k.file().to_string()).collect();
        registered.sort();
        assert_eq!(on_disk, registered);
        for k in KernelSource::all() {
            let text = std::fs::read_to_string(kernels_dir().join(k.file())).unwrap();
            assert_eq!(k.text(), text, "{} is embedded as it is on disk", k.file());
            let launcher = kernels_dir().join(k.file().replace(".cpp", ".rs"));
            assert!(launcher.exists(), "{} has no launcher beside it", k.file());
            assert!(
                std::fs::read_to_string(&launcher).unwrap().contains(&format!("{}.cpp", k.name())),
                "{} does not say which source it launches",
                launcher.display()
            );
            let src = k.assemble();
            for header in ["prelude.h", "gemm.h", "collective.h"] {
                assert!(
                    !src.contains(&format!("#include \"{header}\"")),
                    "{}: {header} not pasted",
                    k.name()
                );
            }
            assert_eq!(src.matches("// ---- prelude.h (pasted by dist-tensor) ----").count(), 1);
        }
    }

    #[test]
    fn every_kernel_compiles_against_the_declared_ascend_c_surface_for_every_type() {
        let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
        if Command::new(&compiler).arg("--version").output().is_err() {
            eprintln!("SKIPPED: no C++ compiler ({compiler}) to check the kernel sources with");
            return;
        }
        let scratch = Path::new(env!("CARGO_TARGET_TMPDIR")).join("ascend_kernels");
        std::fs::create_dir_all(&scratch).unwrap();
        for k in KernelSource::all() {
            // What aclrtc gets: the headers pasted in, no include path for them.
            let file = scratch.join(k.file());
            std::fs::write(&file, k.assemble()).unwrap();
            for elem in ["half", "bfloat16_t", "float"] {
                let out = Command::new(&compiler)
                    .args(["-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror"])
                    .arg(format!("-DDT_ELEM={elem}"))
                    .arg("-I")
                    .arg(surface_dir())
                    .arg(&file)
                    .output()
                    .expect("run the C++ compiler");
                assert!(
                    out.status.success(),
                    "{} (DT_ELEM={elem}) does not compile against the declared surface:\n{}",
                    k.file(),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
    }

    #[test]
    fn every_kernel_follows_the_seeds_conventions() {
        for k in KernelSource::all() {
            check_all(k.file(), k.text()).unwrap();
        }
        // The headers' helpers: no padding there either, and the collectives' notify rotated.
        for header in ["prelude.h", "gemm.h", "collective.h"] {
            let src = std::fs::read_to_string(kernels_dir().join(header)).unwrap();
            check_masks_not_padding(header, &src, false).unwrap();
            check_core_counts(header, &src).unwrap();
        }
        let collective = std::fs::read_to_string(kernels_dir().join("collective.h")).unwrap();
        assert!(calls(&collective, "notify_add").iter().all(|(_, a)| rotated(&a[2])));
        // The helper the kernels locate their rotated tasks with does rotate.
        let prelude = std::fs::read_to_string(kernels_dir().join("prelude.h")).unwrap();
        let helper = &prelude[prelude.find("int64_t locate_rotated(").expect("the helper")..];
        let body = &helper[..helper.find("\n}\n").expect("its end")];
        assert!(body.contains("const int64_t r = (me + i) % world;"), "{body}");
    }

    #[test]
    fn kernels_and_launchers_agree_on_the_shared_constants() {
        let prelude = std::fs::read_to_string(kernels_dir().join("prelude.h")).unwrap();
        let module = std::fs::read_to_string(kernels_dir().join("mod.rs")).unwrap();
        for constant in ["UB_TILE_BYTES", "UB_REDUCE_BYTES"] {
            let value = |text: &str, marker: &str| {
                let at = text.find(marker).unwrap_or_else(|| panic!("{constant} in {marker}"));
                text[at + marker.len()..].split(';').next().unwrap().trim().to_string()
            };
            let c = value(&prelude, &format!("constexpr uint32_t {constant} ="));
            let rust = value(&module, &format!("pub(crate) const {constant}: usize ="));
            assert_eq!(c, rust, "{constant}");
        }
    }

    // ---- each check rejects what it is there to catch ----------------------------------

    const GOOD_MIX: &str = r#"
extern "C" __global__ __aicore__ void demo(GM_ADDR buf) {
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
    const int64_t pid = program_id_mix(), ncore = num_programs(), sub = sub_vec_id_mix();
    if (sub == 0) {
        for (int64_t task = pid; task < (world - 1) * chunks; task += ncore) {
            const int64_t peer = (me + 1 + task / chunks) % world;
            const Chunk c = chunk_at(task % chunks, mine, k, row_step, col_step);
            copy_2d(symm_at(rows, peer) + c.row * k, k, x, k, c.rows, c.cols, ub);
            notify_add(signals, me, peer, 1);
        }
    }
}
"#;

    #[test]
    fn the_checks_accept_a_kernel_that_follows_the_conventions() {
        check_all("good", GOOD_MIX).unwrap();
    }

    #[test]
    fn a_kernel_that_pads_instead_of_masking_is_rejected() {
        let bad = GOOD_MIX.replace(
            "const Chunk c",
            "AscendC::DataCopyPadExtParams<elem_t> pad{true, 0, 7, 0};\n            const Chunk c",
        );
        let err = check_masks_not_padding("bad", &bad, true).unwrap_err();
        assert!(err.contains("a DataCopyPad pads"), "{err}");
        let zero_filled =
            GOOD_MIX.replace("copy_2d(", "AscendC::Duplicate(ub, 0, n);\n            copy_2d(");
        assert!(check_masks_not_padding("bad", &zero_filled, true).is_err());
        let unmasked = GOOD_MIX.replace("chunk_at(", "whole_chunk(");
        assert!(check_masks_not_padding("bad", &unmasked, true).unwrap_err().contains("no masks"));
    }

    #[test]
    fn a_kernel_without_rank_rotation_is_rejected() {
        let bad = GOOD_MIX.replace("(me + 1 + task / chunks) % world", "task / chunks");
        let err = check_rank_rotation("bad", &bad).unwrap_err();
        assert!(err.contains("symm_at reaches rank `peer`, not rotated"), "{err}");
        let direct =
            GOOD_MIX.replace("notify_add(signals, me, peer, 1)", "notify_add(signals, me, i, 1)");
        assert!(check_rank_rotation("bad", &direct).unwrap_err().contains("notify_add"));
    }

    #[test]
    fn a_mix_kernel_communicating_outside_sub_vec_0_is_rejected() {
        let bad = GOOD_MIX.replace("if (sub == 0) {", "if (sub == 1) {");
        let err = check_sub_vec_gating("bad", &bad).unwrap_err();
        assert!(err.contains("outside a sub_vec_id == 0 section"), "{err}");
        // Vector-only kernels have one sub-core: nothing to gate.
        let vector_only = bad.replace("KERNEL_TYPE_MIX_AIC_1_2", "KERNEL_TYPE_AIV_ONLY");
        check_sub_vec_gating("vector", &vector_only).unwrap();
    }

    #[test]
    fn a_kernel_sharing_cores_over_ranks_only_or_counting_cores_itself_is_rejected() {
        let one_dim = GOOD_MIX.replace(
            "for (int64_t task = pid; task < (world - 1) * chunks; task += ncore) {",
            "for (int64_t task = pid; task < world; task += ncore) {",
        );
        assert!(check_grid_stride_flattened("bad", &one_dim).is_err());
        let constant = GOOD_MIX.replace("task += ncore", "task += 24");
        assert!(check_core_counts("bad", &constant).unwrap_err().contains("constant 24"));
        let fixed = GOOD_MIX.replace("ncore = num_programs()", "ncore = 48");
        assert!(check_core_counts("bad", &fixed).is_err());
    }
}
