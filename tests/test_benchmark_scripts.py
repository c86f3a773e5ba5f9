"""CPU checks of the scripts under benchmarks/tools/ and benchmarks/runs/ (loaded from their paths; they are not
a package)."""
import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(path: str):
    """A script under benchmarks/ as a module; path: its folder and stem there, e.g. "runs/max_logit"."""
    name = Path(path).name
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{path}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refused(main, argv: list, capsys) -> str:
    """A tool's ``main(argv)``, which must stop as argparse's errors do (SystemExit, code 2): its stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2, argv
    return capsys.readouterr().err


def fake_bench(tf: dict, providers=("stableflash-none", "stableflash", "stableflash-fp8")) -> dict:
    """A tiny `stableflash bench attention` JSON: tf maps (shape, provider) to TFLOP/s."""
    rows = [{"shape": list(s), "mode": "fwd+bwd", "provider": p, "ms": 1.0, "tflops": t} for (s, p), t in tf.items()]
    return {"config": {"providers": list(providers)}, "rows": rows}


SMALL, BIG = (2, 4, 512, 64), (1, 4, 2048, 64)


def quick_poll(tmp_path: Path) -> Path:
    """A folder holding a `sleep` to put ahead on PATH: the scripts look every 5 s whether a run's
    process group has ended (`sleep 5`); this one makes that wait 0.2 s and passes any other through."""
    import shutil
    shim = tmp_path / "bin" / "sleep"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\n[ "$*" = 5 ] && exec {shutil.which("sleep")} 0.2\nexec {shutil.which("sleep")} "$@"\n')
    shim.chmod(0o755)
    return shim.parent


def test_mitigation_costs_median_over_files(tmp_path, monkeypatch, capsys):
    mc = load("tools/mitigation_costs")
    a = fake_bench({(SMALL, "stableflash-none"): 200.0, (SMALL, "stableflash"): 100.0, (SMALL, "stableflash-fp8"): 160.0,
                    (BIG, "stableflash-none"): 300.0, (BIG, "stableflash"): 250.0})
    b = fake_bench({(SMALL, "stableflash-none"): 200.0, (SMALL, "stableflash"): 200.0, (SMALL, "stableflash-fp8"): 100.0})
    c = fake_bench({(SMALL, "stableflash-none"): 150.0, (SMALL, "stableflash"): 100.0, (SMALL, "stableflash-fp8"): 150.0})
    table = mc.costs([a, b, c], "stableflash-none")
    # per-file costs: stable 200/100-1 = 1.0, 0.0, 0.5 -> median 0.5; fp8 0.25, 1.0, 0.0 -> median 0.25
    assert sorted(table) == [("stableflash", BIG), ("stableflash", SMALL), ("stableflash-fp8", SMALL)]
    assert sorted(table["stableflash", SMALL]) == pytest.approx([0.0, 0.5, 1.0], abs=1e-12)
    assert sorted(table["stableflash-fp8", SMALL]) == pytest.approx([0.0, 0.25, 1.0], abs=1e-12)
    assert table["stableflash", BIG] == pytest.approx([0.2], abs=1e-12)     # only file a has the big shape

    paths = []
    for i, d in enumerate((a, b, c)):
        paths.append(tmp_path / f"bench-{i}.json")
        paths[-1].write_text(json.dumps(d))
    monkeypatch.setattr(sys, "argv", ["mitigation_costs.py", *map(str, paths), "--against", "stableflash-none"])
    mc.main()
    lines = capsys.readouterr().out.splitlines()
    stable = next(line for line in lines if line.startswith("stableflash "))
    fp8 = next(line for line in lines if line.startswith("stableflash-fp8"))
    assert "+50.0% [+0.0%, +100.0%] n=3" in stable and "+20.0% [+20.0%, +20.0%] n=1" in stable
    assert "+25.0% [+0.0%, +100.0%] n=3" in fp8 and fp8.rstrip().endswith("-")


def test_mitigation_costs_reads_a_file_with_the_earlier_provider_names(tmp_path, monkeypatch, capsys):
    """Result files written before the providers were named stableflash-* still load, under the
    names they recorded (what an earlier name ran changed between files), against the earlier
    name of the unstabilized kernel by default."""
    mc = load("tools/mitigation_costs")
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(fake_bench({(SMALL, "ours-standard"): 200.0, (SMALL, "ours-stable"): 100.0},
                                          providers=("ours-standard", "ours-stable"))))
    monkeypatch.setattr(sys, "argv", ["mitigation_costs.py", str(path)])
    mc.main()
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("ours-stable "))
    assert "+100.0%" in line


def test_mitigation_costs_one_file_keeps_its_table(tmp_path, monkeypatch, capsys):
    mc = load("tools/mitigation_costs")
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(fake_bench({(SMALL, "stableflash-none"): 200.0, (SMALL, "stableflash"): 100.0,
                                           (SMALL, "sdpa-flash"): 50.0})))
    monkeypatch.setattr(sys, "argv", ["mitigation_costs.py", str(path)])
    mc.main()
    out = capsys.readouterr().out
    assert "ratio to sdpa-flash" in out and "+100.0% (100 TF/s, 2.00x flash)" in out


def test_mitigation_costs_keeps_a_long_providers_name_apart_from_its_cells(tmp_path, monkeypatch, capsys):
    """Provider names longer than the old 16-character column (stableflash-none-fp8-pv) ran into their
    first cell; the name column now fits the longest name, and cells are space-separated."""
    import re

    mc = load("tools/mitigation_costs")
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(fake_bench({(SMALL, "stableflash-none"): 200.0, (SMALL, "stableflash-none-fp8-pv"): 100.0,
                                           (BIG, "stableflash-none"): 200.0, (BIG, "stableflash-none-fp8-pv"): 160.0},
                                          providers=("stableflash-none", "stableflash-none-fp8-pv"))))
    for argv in ([str(path)], [str(path), str(path)]):
        monkeypatch.setattr(sys, "argv", ["mitigation_costs.py", *argv])
        mc.main()
        line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("stableflash-none-fp8-pv"))
        assert re.match(r"stableflash-none-fp8-pv\s+\+100\.0% .*\s\+25\.0% ", line), line


@pytest.mark.slow
def test_detached_runs_wait_ends_when_every_run_has_stopped(tmp_path):
    """`repro_detached.sh wait SECONDS` returns once every started run's process group has ended
    (a `pgrep -f` loop in the calling shell matched itself and always waited its full time), and
    still packs the runs. Its look every 5 s is one every 0.2 s here (``quick_poll``)."""
    import shutil
    import subprocess
    import time

    if shutil.which("setsid") is None:
        pytest.skip("needs setsid")
    root = tmp_path / "detached"
    (root / "run1" / "seed0").mkdir(parents=True)
    (root / "run1" / "seed0" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "ms": 3.0}\n')
    import threading

    sleeper = subprocess.Popen(["setsid", "sleep", "2"])          # its own process group, as `start` makes
    threading.Thread(target=sleeper.wait, daemon=True).start()    # reaped when it ends, not left a zombie
    (root / "run1.pgid").write_text(f"{sleeper.pid}\n")
    start = time.monotonic()
    out = subprocess.run(["bash", str(BENCHMARKS / "runs" / "repro_detached.sh"), "wait", "60"], capture_output=True,
                         text=True, env={"PATH": f"{quick_poll(tmp_path)}:/usr/bin:/bin", "DETACHED_ROOT": str(root),
                                         "OUT": str(tmp_path)},
                         cwd=BENCHMARKS.parent, timeout=90)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - start < 30 and "of 60" in out.stdout
    assert (tmp_path / "detached.tgz").stat().st_size > 0


def test_max_logit_reads_each_probe_and_finds_the_first_step_past_the_edge(tmp_path, monkeypatch, capsys):
    ml = load("runs/max_logit")
    run = tmp_path / "runs" / "seed0" / "baseline"
    run.mkdir(parents=True)
    records = [(0, [[1.0, 0.5], [0.2, 0.9]]), (100, [[40.0, 3.0], [88.5, 2.0]]), (200, [[90.0, 95.5], [1.0, 1.0]])]
    run.joinpath("probes.jsonl").write_text(
        "".join(json.dumps({"step": s, "row": {"max_logit": m}}) + "\n" for s, m in records))
    run.joinpath("metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 3.0}) + "\n")
    assert ml.max_logits(run) == [(0, 1.0), (100, 88.5), (200, 95.5)]
    monkeypatch.setattr(sys, "argv", ["max_logit.py", str(tmp_path / "runs"), "--edge", "90"])
    ml.main()
    out = capsys.readouterr().out
    assert "first above 90:   200" in out and "0:1 100:88 200:96" in out      # 88.5 and 95.5 round to even
    monkeypatch.setattr(sys, "argv", ["max_logit.py", str(tmp_path)])
    ml.main()
    assert "first above 87:   100" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(sys, "argv", ["max_logit.py", str(empty)])
    with pytest.raises(SystemExit, match="holds no probes.jsonl"):
        ml.main()
    orphan = tmp_path / "orphan"                       # probes without the run's metrics.jsonl
    orphan.mkdir()
    orphan.joinpath("probes.jsonl").write_text(json.dumps({"step": 0, "row": {"max_logit": [[1.0]]}}) + "\n")
    monkeypatch.setattr(sys, "argv", ["max_logit.py", str(orphan)])
    with pytest.raises(SystemExit, match="has no metrics.jsonl"):
        ml.main()


def test_plot_loss_draws_the_runs_and_refuses_a_folder_without_metrics(tmp_path, monkeypatch):
    import argparse

    pl = load("runs/plot_loss")
    runs = []
    for name, status, losses in (("held", "finished", [3.0, 2.0, 1.5, 1.2]), ("boom", "exploded", [3.0, 2.0, 6.0])):
        run = tmp_path / name
        run.mkdir()
        lines = [{"step": 10 * i, "loss": v} for i, v in enumerate(losses)]
        lines.append({"step": 15, "event": "monitor_action", "action": "switch", "layers": [0]})
        run.joinpath("metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        run.joinpath("summary.json").write_text(json.dumps({"status": status}))
        runs.append(f"{name} run={run}")
    out = tmp_path / "loss.png"
    monkeypatch.setattr(sys, "argv", ["plot_loss.py", str(out), "--run", runs[0], "--run", runs[1],
                                      "--dashed", "held run", "--ylim", "0.5", "10", "--title", "t"])
    pl.main()
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    assert pl.parse_run(runs[0]) == ("held run", tmp_path / "held")
    with pytest.raises(argparse.ArgumentTypeError, match="holds no metrics.jsonl"):
        pl.parse_run(f"x={tmp_path}")
    with pytest.raises(argparse.ArgumentTypeError, match="accepted: LABEL=RUN_DIR"):
        pl.parse_run(str(tmp_path / "held"))


def test_kernel_digest_writes_and_compares_digests(tmp_path, monkeypatch, capsys):
    pytest.importorskip("triton")
    kd = load("tools/kernel_digest")
    out = tmp_path / "a.json"
    monkeypatch.setattr(sys, "argv", ["kernel_digest.py", "--only", "fa2 tie-shift", "paper e8m5", "--out", str(out)])
    kd.main()
    digests = json.loads(out.read_text())["digests"]
    assert list(digests) == ["fa2 tie-shift", "paper e8m5"]
    assert all(len(h) == 64 for d in digests.values() for h in d.values()) and set(digests["paper e8m5"]) == {
        "O", "dQ", "dK", "dV"}
    assert kd.compare(out, out) == 0
    changed = json.loads(out.read_text())
    changed["digests"]["paper e8m5"]["dQ"] = "0" * 64
    (tmp_path / "b.json").write_text(json.dumps(changed))
    assert kd.compare(out, tmp_path / "b.json") == 1
    assert "differs: paper e8m5" in capsys.readouterr().out


def test_the_compile_tools_give_the_forward_every_switch_it_takes():
    """compile_check's variants and sass_count's configurations, built through the launcher's own
    conversion, set exactly the forward kernel's compile-time parameters (checked without compiling)."""
    pytest.importorskip("triton")
    import inspect

    from stableflash.attention.triton.forward import attn_fwd_kernel
    cc, sc = load("tools/compile_check"), load("tools/sass_count")
    params = inspect.signature(attn_fwd_kernel.fn).parameters
    wanted = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
    assert {"STAB", "FMT", "PFMT", "FP8_PV", "DELTA_SRC", "TMA", "INTERP"} <= wanted
    for name, (config, launch) in cc.forward_variants().items():
        const, pointers = cc.forward_job(config, launch)
        assert set(const) == wanted, name
        assert set(pointers) <= {"O32", "V8"}, name
    for name, job in sc.configs().items():
        const, _, _ = sc.forward_job(*job)
        assert set(const) | {"HEAD_DIM", "BLOCK_M", "BLOCK_N", "CAUSAL"} == wanted, name


def test_gluon_backward_check_takes_tiles_by_name_and_names_what_it_accepts(capsys):
    """--tiles BLOCK_NxBLOCK_MxSTAGES[a|as] or .../DQ_BLOCK_MxDQ_BLOCK_NxDQ_STAGES, then [rNNN], becomes
    the backward's BackwardTiles (checked by BackwardTiles.check; "as": atomic dQ with skip_hidden); a bad
    value stops the command line with an error naming --tiles, the value and the accepted form."""
    pytest.importorskip("triton.experimental.gluon")
    gbc = load("tools/gluon_backward_check")
    from stableflash.attention.gluon.hopper_backward import BackwardTiles, atomic_backward_tiles
    assert gbc.parse_tiles("128x64x3as") == atomic_backward_tiles(128)
    assert gbc.parse_tiles("128x64x3a") == atomic_backward_tiles(128)._replace(skip_hidden=False)
    assert gbc.parse_tiles("128x64x3asr128").skip_hidden
    assert gbc.parse_tiles("128x128x2a") == atomic_backward_tiles(64)
    assert gbc.parse_tiles("64x64x3ar128") == BackwardTiles(64, 64, 3, 128, 128, 2, atomic_dq=True, max_registers=128)
    assert gbc.parse_tiles("128x64x2/128x64x2") == BackwardTiles(128, 64, 2, 128, 64, 2)
    for bad, said in (("128x64", "BLOCK_NxBLOCK_MxSTAGES"), ("96x64x3a", "block_n and dq_block_m 64 or 128"),
                      ("128x64x3ar", "BLOCK_NxBLOCK_MxSTAGES"), ("128x64x3a/128x64x2", "BLOCK_NxBLOCK_MxSTAGES"),
                      ("128x64x3ar300", "max_registers None or an int"), ("128x64x3s", "BLOCK_NxBLOCK_MxSTAGES")):
        err = refused(gbc.main, ["--tiles", bad], capsys)
        assert f"--tiles '{bad}'" in err and said in err, err


def test_gluon_forward_check_takes_tiles_by_name_and_names_what_it_accepts(capsys):
    """--tiles BLOCK_MxBLOCK_NxSTAGES[p|n][rNNN] becomes the kernel's Tiles (checked by Tiles.check); a bad
    value stops the command line with an error naming --tiles, the value and the accepted form."""
    pytest.importorskip("triton.experimental.gluon")
    gfc = load("tools/gluon_forward_check")
    from stableflash.attention.gluon.hopper_forward import Tiles, tiles_for
    assert gfc.parse_tiles("64x128x3") == Tiles(64, 128, 3)
    assert gfc.parse_tiles("128x128x2P") == tiles_for(128, True)
    assert gfc.parse_tiles("128x128x2Pd") == tiles_for(64, True)
    assert gfc.parse_tiles("128x128x3p") == Tiles(128, 128, 3, pingpong=True)
    assert gfc.tiles_name(tiles_for(64, True)) == "gluon-128x128x2Pd"
    assert gfc.parse_tiles("64x128x2n") == Tiles(64, 128, 2, warp_specialize=False)
    assert gfc.parse_tiles("64x128x2r128") == Tiles(64, 128, 2, max_registers=128)
    from stableflash.attention.triton import assembler
    assert Tiles(64, 128, 2, max_registers=128).options == {"num_warps": 4, "enable_fp_fusion": True, "maxnreg": 128,
                                                            **assembler.options()}
    assert [gfc.tiles_name(gfc.parse_tiles(t)) for t in ("128x64x2p", "128x128x2P", "64x128x2n", "64x64x4",
                                                               "64x64x3r128")] == [
        "gluon-128x64x2p", "gluon-128x128x2P", "gluon-64x128x2n", "gluon-64x64x4", "gluon-64x64x3r128"]
    for bad, said in (("64x128", "BLOCK_MxBLOCK_NxSTAGES"), ("64x100x3", "block_n 16-256 in steps of 16"),
                      ("64x128x3p", "ping-pong takes block_m=128"), ("64x128x3P", "ping-pong takes block_m=128"), ("64x128xthree", "BLOCK_MxBLOCK_NxSTAGES"),
                      ("64x128x3q", "BLOCK_MxBLOCK_NxSTAGES"), ("128x128x2Pq", "BLOCK_MxBLOCK_NxSTAGES"),
                      ("128x64x2Pd", "narrow_diagonal takes persistent=True and block_n == block_m"), ("64x128x3r", "BLOCK_MxBLOCK_NxSTAGES"),
                      ("64x128x3r12x", "BLOCK_MxBLOCK_NxSTAGES"), ("64x128x3r300", "max_registers None or an int")):
        err = refused(gfc.main, ["--tiles", bad], capsys)
        assert f"--tiles '{bad}'" in err and said in err, err


def test_gluon_checks_refuse_bad_shapes_and_time_only_on_hopper(capsys, monkeypatch):
    """gluon_forward_check.py and gluon_backward_check.py (their shared command line): a malformed
    --shapes value is refused with the argument named, and --time without a Hopper GPU stops with
    that said (exit 2), not with an error from inside CUDA."""
    pytest.importorskip("triton.experimental.gluon")
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for tool in ("tools/gluon_forward_check", "tools/gluon_backward_check"):
        check = load(tool)
        for argv, said in ((["--time", "--shapes", "1,2,x"], "argument --shapes: shape '1,2,x' is invalid"),
                           (["--time", "--shapes", "2,4,256,64"], "--time needs a Hopper GPU")):
            assert said in refused(check.main, argv, capsys), (tool, argv)


def test_faithful_report_tabulates_a_run_and_its_fork_and_remakes_them_from_its_record(data_dir, tmp_path, capsys):
    """A tiny run and a fork of it resumed with other arithmetic (as faithful_gpt2.sh fork makes):
    the record keeps the fork's own steps, the table gives each run's steps, losses and last
    probe, the figure is written, and --from runs.json makes the same table again."""
    import shutil

    from stableflash.cli import main as cli
    from stableflash.report.runs import load_run
    report = load("runs/faithful_report")
    base = tmp_path / "base"
    assert cli(["train", "--preset", "tiny", "--out", str(base), "-q", "--set", f"data={data_dir}",
                "--set", "max_iters=6", "--set", "ckpt_every=3", "--set", "probe_every=2",
                "--set", "attention=sdpa"]) == 0
    shutil.copytree(base, tmp_path / "fork")
    assert cli(["train", "--resume", str(tmp_path / "fork"), "-q", "--set", "max_iters=10",
                "--set", "attention=emulated stabilize=none policy=fa2"]) == 0
    out = tmp_path / "report"
    assert report.main(["--out", str(out), "--run", f"base=a={base}", "--run", f"fork={tmp_path / 'fork'}",
                        "--fork", "fork=base=a@6", "--machine", "base=a=CPU"]) == 0
    records = json.loads((out / "runs.json").read_text())
    assert [r["label"] for r in records] == ["base=a", "fork"] and records[0]["machine"] == "CPU"
    assert [s for s, _ in records[1]["loss"]] == [6, 7, 8, 9] and records[1]["forked_at"] == 6
    assert [p["step"] for p in records[1]["probes"]] == [6, 8] and records[1]["attention"].startswith("emulated")
    fork_losses = [r["loss"] for r in load_run(tmp_path / "fork").metrics if r["step"] >= 6]
    assert [v for _, v in records[1]["loss"]] == pytest.approx(fork_losses, abs=1e-5)   # kept to 5 decimals
    rows = json.loads((out / "table.json").read_text())
    assert [r["steps"] for r in rows] == ["0-5", "6-9"] and [r["last_probe"] for r in rows] == [4, 8]
    assert rows[1]["min_loss"] == pytest.approx(min(fork_losses), abs=1e-5) and rows[0]["explosion_step"] is None
    assert (out / "indicators.png").stat().st_size > 10_000
    table = (out / "table.txt").read_text()
    capsys.readouterr()
    assert report.main(["--from", str(out / "runs.json"), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "table.txt").read_text() == table
    # the record as committed, xz-compressed, makes the same table; a file that is no record is refused
    import lzma
    (tmp_path / "runs.json.xz").write_bytes(lzma.compress((out / "runs.json").read_bytes()))
    assert report.main(["--from", str(tmp_path / "runs.json.xz"), "--out", str(tmp_path / "from-xz")]) == 0
    assert (tmp_path / "from-xz" / "table.txt").read_text() == table
    (tmp_path / "bad.json.xz").write_bytes(b"not xz")
    (tmp_path / "other.json").write_text('{"label": "x"}')
    for bad, said in [("bad.json.xz", "LZMAError"), ("missing.json", "FileNotFoundError"),
                      ("other.json", "expected a list of run records")]:
        err = refused(report.main, ["--from", str(tmp_path / bad), "--out", str(tmp_path / "x")], capsys)
        assert f"--from '{tmp_path / bad}'" in err and said in err, err
    # a later run joins the committed record: its records first, as they were, then the new run's
    assert report.main(["--from", str(out / "runs.json"), "--run", f"later={base}", "--machine", "later=GPU",
                        "--out", str(tmp_path / "joined")]) == 0
    joined = json.loads((tmp_path / "joined" / "runs.json").read_text())
    assert joined[:2] == records and joined[2]["label"] == "later" and joined[2]["machine"] == "GPU"
    assert (tmp_path / "joined" / "table.txt").read_text().splitlines()[:3] == table.splitlines()
    assert "--run labels already in" in refused(
        report.main, ["--from", str(out / "runs.json"), "--run", f"fork={base}", "--out", str(tmp_path / "x")], capsys)
    assert f"--run gone={tmp_path / 'gone'}: no metrics.jsonl there" in refused(
        report.main, ["--run", f"gone={tmp_path / 'gone'}", "--out", str(tmp_path / "x")], capsys)
    assert "no --run gives: other" in refused(
        report.main, ["--out", str(out), "--run", f"base={base}", "--fork", "other=base@6"], capsys)


def test_faithful_fork_resumes_a_copy_with_the_given_arithmetic(data_dir, tmp_path):
    """`faithful_gpt2.sh fork NAME FROM ATTENTION STEPS` copies run FROM and resumes the copy detached
    with ATTENTION (a name of the script's, or a spec: here one the CPU runs) up to STEPS; FROM is left
    as it was."""
    import shutil
    import subprocess
    import time

    from stableflash.cli import main as cli
    if shutil.which("setsid") is None:
        pytest.skip("needs setsid")
    root = tmp_path / "detached"
    assert cli(["train", "--preset", "tiny", "--out", str(root / "base"), "-q", "--set", f"data={data_dir}",
                "--set", "max_iters=4", "--set", "ckpt_every=2"]) == 0
    before = (root / "base" / "metrics.jsonl").read_text()
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "DETACHED_ROOT": str(root), "HOME": str(tmp_path)}
    out = subprocess.run(["bash", str(BENCHMARKS / "runs" / "faithful_gpt2.sh"), "fork", "f", "base",
                          "emulated stabilize=none policy=fa2 out=fp32", "6",
                          "--set", "compile=false"], capture_output=True, text=True, env=env, cwd=BENCHMARKS.parent,
                         timeout=60)
    assert out.returncode == 0 and "started f" in out.stdout, out.stdout + out.stderr
    import os
    pgid, deadline = int((root / "f.pgid").read_text()), time.monotonic() + 120   # the copy holds base's summary:
    assert os.getpgid(pgid) == pgid                     # the script returned once the fork led its own group
    while time.monotonic() < deadline:                  # wait for the fork's process group to end
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    summary = json.loads((root / "f" / "summary.json").read_text())
    assert summary["steps"] == 6, (root / "f.log").read_text()[-2000:]
    assert summary["final_attention"] == "emulated stabilize=none policy=fa2 out=fp32"
    assert (root / "base" / "metrics.jsonl").read_text() == before


def test_faithful_queue_runs_its_runs_one_after_another(data_dir, tmp_path):
    """`faithful_gpt2.sh queue STEPS NAME SEED ATTENTION ...` trains each run from step 0 to STEPS,
    the next starting only once the previous one's process group has ended, each with its own seed
    and arithmetic, and the micro-batch and micro-batches per step that BATCH and ACCUM set."""
    import os
    import shutil
    import subprocess

    if shutil.which("setsid") is None:
        pytest.skip("needs setsid")
    root = tmp_path / "detached"
    # the queue looks every 5 s for the previous run's end (`sleep 5`): here every 0.2 s (``quick_poll``)
    env = {"PATH": f"{quick_poll(tmp_path)}:{Path(sys.executable).parent}:/usr/bin:/bin", "DETACHED_ROOT": str(root),
           "HOME": str(tmp_path), "DATA": str(data_dir), "PRESET": "tiny", "BATCH": "4", "ACCUM": "2"}
    out = subprocess.run(["bash", str(BENCHMARKS / "runs" / "faithful_gpt2.sh"), "queue", "2",
                          "a", "0", "sdpa", "b", "1", "emulated stabilize=none policy=fa2"],
                         capture_output=True, text=True, env=env, cwd=BENCHMARKS.parent, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    summaries = {n: json.loads((root / n / "summary.json").read_text()) for n in "ab"}
    configs = {n: json.loads((root / n / "config.json").read_text()) for n in "ab"}
    assert [summaries[n]["steps"] for n in "ab"] == [2, 2], (root / "b.log").read_text()[-2000:]
    assert [configs[n]["seed"] for n in "ab"] == [0, 1]
    assert [(configs[n]["batch_size"], configs[n]["grad_accum"]) for n in "ab"] == [(4, 2), (4, 2)]   # BATCH, ACCUM
    assert [configs[n]["attention"] for n in "ab"] == ["sdpa", "emulated stabilize=none policy=fa2"]
    # one after the other: b's run folder was made after a's summary was written
    assert os.stat(root / "b" / "config.json").st_mtime >= os.stat(root / "a" / "summary.json").st_mtime


def test_gluon_compiles_a_hopper_warpgroup_product_without_a_gpu():
    """benchmarks/tools/gluon_hopper_probe.py: a 64 × 64 × 64 Gluon warpgroup product compiles for
    sm_90a with the triton wheel's own ptxas, and its SASS holds the K / 16 = 4 HGMMA instructions
    of one warpgroup tile — the ground a Gluon Hopper path is built and inspected on in CI."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    import triton
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm").exists():
        pytest.skip("this triton wheel ships no nvdisasm")
    result = load("tools/gluon_hopper_probe").probe()
    assert result["hgmma"] == 4 and result["ptx_has_wgmma"] and result["target"] == "sm_90a", result


def test_train_profile_sums_the_gpus_idle_time_by_the_kernel_it_waited_for():
    """Kernels as the profiler lists them (µs): a gap counts once, before the kernel that ends it, and
    per step; kernels that overlap leave no gap; CPU events are not kernels."""
    import torch
    from types import SimpleNamespace as Event

    tool = load("tools/train_profile")
    gpu, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ev = lambda a, b, name, kind=gpu: Event(time_range=Event(start=a, end=b), name=name, device_type=kind)  # noqa: E731
    events = [ev(0, 10, "gemm"), ev(15, 20, "attn_fwd_kernel"), ev(18, 30, "gemm"), ev(40, 41, "gemm"),
              ev(0, 500, "aten::mm", cpu), ev(1041, 1050, "attn_fwd_kernel")]
    got = tool.idle_before(events, steps=2)
    assert got["idle_ms_per_step"] == pytest.approx((5 + 10 + 1000) / 1e3 / 2)
    by = {r["kernel"]: r for r in got["idle_before"]}
    assert by["attn_fwd_kernel"]["ms_per_step"] == pytest.approx(1005 / 1e3 / 2)
    assert by["attn_fwd_kernel"]["gaps_per_step"] == 1.0 and by["attn_fwd_kernel"]["group"] == "attention"
    assert by["gemm"]["ms_per_step"] == pytest.approx(10 / 1e3 / 2)
    assert [r["kernel"] for r in got["idle_before"]] == ["attn_fwd_kernel", "gemm"]


def test_train_tuner_picks_prints_each_tuners_picks_and_timings_as_json(monkeypatch, capsys):
    """After the CLI call it wraps (stubbed here: no GPU), one CHOICES and one TIMINGS line, each JSON
    with an entry per tuner it names."""
    import json
    tool = load("tools/train_tuner_picks")
    seen = []
    monkeypatch.setattr(tool, "cli_main", lambda argv: seen.append(argv) or 3)
    assert tool.main(["bench", "train", "--steps", "2"]) == 3
    assert seen == [["bench", "train", "--steps", "2"]]
    lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in capsys.readouterr().out.splitlines()}
    assert set(lines["CHOICES"]) == {"fwd", "fwd_tma", "dkdv", "dq", "delta_pass"}
    assert set(lines["TIMINGS"]) == {"fwd", "fwd_tma", "dkdv", "dq"}


def test_kernel_breakdown_names_bad_arguments_before_it_looks_for_a_gpu(capsys, monkeypatch):
    """benchmarks/tools/kernel_breakdown.py: a malformed shape, a count of calls below one, both causal
    switches, an unknown provider or layout is refused (exit 2) with the argument named, whether or not a GPU
    is present; well-formed arguments without a GPU stop at the GPU check."""
    import torch
    tool = load("tools/kernel_breakdown")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, named in ((["--shape", "8,16,2048"], "argument --shape: shape '8,16,2048' is invalid"),
                        (["--calls", "0"], "--calls 0"), (["--causal", "--no-causal"], "--causal and --no-causal"),
                        (["--providers", "nope"], "argument --providers: provider 'nope' is unknown"),
                        (["--layout", "bshd"], "argument --layout: invalid choice: 'bshd'"),
                        ([], "needs a CUDA GPU"), (["--graph", "--forward-only"], "needs a CUDA GPU")):
        assert named in refused(tool.main, argv, capsys), argv


def test_kernel_breakdown_reads_graph_replays_from_profiler_events():
    """benchmarks/tools/kernel_breakdown.py --graph: two replays of a three-kernel graph, given out of
    order — each kernel's mean time and the mean gap before it, in the order the kernels ran, the
    kernels' sum and the mean span; replays whose kernels differ, or a count of events that is not a
    multiple of the replays, are refused."""
    tool = load("tools/kernel_breakdown")
    first = [("fwd", 0.0, 10.0), ("delta", 11.0, 13.0), ("bwd", 13.5, 33.5)]
    second = [("fwd", 100.0, 112.0), ("delta", 115.0, 117.0), ("bwd", 117.5, 139.5)]
    got = tool.per_replay(second + first[::-1], calls=2)
    assert [k["kernel"] for k in got["kernels"]] == ["fwd", "delta", "bwd"]
    assert [k["us"] for k in got["kernels"]] == [11.0, 2.0, 21.0]
    assert [k["gap_before_us"] for k in got["kernels"]] == [None, 2.0, 0.5]
    assert got["kernel_sum_us"] == 34.0 and got["span_us"] == (33.5 + 39.5) / 2
    with pytest.raises(ValueError, match="differ in name or order"):
        tool.per_replay(first + [("fwd", 100.0, 112.0), ("bwd", 113.0, 120.0), ("delta", 121.0, 122.0)], calls=2)
    with pytest.raises(ValueError, match="5 kernels for 2 replays"):
        tool.per_replay(first + second[:2], calls=2)


def test_ncu_attention_table_reads_a_raw_export_and_names_what_it_lacks(tmp_path, capsys):
    ncu = load("tools/ncu_attention")
    head = ["ID", "Kernel Name", "gpu__time_duration.sum", "smsp__inst_executed.sum",
            "smsp__issue_active.avg.pct_of_peak_sustained_active", "sm__warps_active.avg.pct_of_peak_sustained_active",
            "launch__registers_per_thread", "launch__occupancy_limit_registers", "launch__occupancy_limit_shared_mem",
            "launch__block_size", "launch__grid_size", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
            "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
            "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
            "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"]
    units = ["", "", "ms", "inst", "%", "%", "register/thread", "block", "block", "", "", "%", "%", "", ""]
    rows = [["0", "attn_fwd_kernel", "0.675296", "354,447,360", "59.7", "24.5", "128", "4", "5", "128", "8,192",
             "50.0", "31.0", "0.74", "1.20"],
            ["1", "void at::elementwise_kernel<128>", "0.01", "1", "1", "1", "16", "32", "32", "128", "1", "1", "1",
             "0", "0"],
            ["2", "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", "1.66", "617,891,940", "40.9", "15.6",
             "168", "1", "1", "384", "132", "18.0", "24.0", "1.28", "0.89"]]
    path = tmp_path / "raw.csv"
    path.write_text("\n".join(",".join(f'"{x}"' for x in r) for r in [head, units, *rows]) + "\n")
    got = ncu.summarize(str(path))
    assert [k["kernel"] for k in got] == ["ours fwd", "cuDNN bprop"]
    fwd = got[0]
    assert fwd["us"] == pytest.approx(675.296) and fwd["warp_instructions_M"] == pytest.approx(354.44736)
    assert fwd["programs_per_sm"] == 4 and fwd["grid"] == 8192
    assert fwd["pipes_pct"] == {"xu": 50.0, "alu": 31.0}
    assert list(fwd["stalls_per_issue"]) == ["wait", "barrier"]
    ncu.table([str(path)])
    out = capsys.readouterr().out
    assert "ours fwd" in out and "cuDNN bprop" in out and "elementwise" not in out
    bad = tmp_path / "details.csv"
    bad.write_text('"ID","Kernel Name","Metric Name"\n"","",""\n"0","attn_fwd_kernel","x"\n')
    with pytest.raises(ValueError, match="gpu__time_duration.sum"):
        ncu.summarize(str(bad))
    with pytest.raises(ValueError, match="missing.csv: cannot be read"):
        ncu.summarize(str(tmp_path / "missing.csv"))


def test_ncu_attention_source_reads_a_per_instruction_export(tmp_path, capsys):
    """``source``: opcodes weighted by executions, the hot loop's samples apart from the rest's, the most
    sampled instructions; a file that is not a source export is named with what is expected."""
    ncu = load("tools/ncu_attention")
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
            "# Samples", "Instructions Executed", "stall_barrier", "stall_wait", "stall_barrier (Not Issued)"]
    body = [["0x0", "      LDC R1, c[0x0][0x28]", "5", "5", "5", "100", "0", "5", "0"],
            ["0x10", "      FMNMX R2, R3, R4, !PT", "30", "20", "30", "1000", "0", "30", "0"],
            ["0x20", "@!P1  PRMT R5, R6, 0x5432, R6", "10", "10", "10", "1000", "0", "10", "0"],
            ["0x30", "      NOP", "55", "55", "55", "100", "55", "0", "55"]]
    rows = [["Kernel Name", "attn_fwd_hopper_kernel"], head, *body]
    path = tmp_path / "src.csv"
    path.write_text("\n".join(",".join(f'"{x}"' for x in r) for r in rows) + "\n")
    (k,) = ncu.source_kernels(str(path))
    assert k["kernel"] == "attn_fwd_hopper_kernel"
    assert k["opcodes"] == {"LDC": 100, "FMNMX": 1000, "PRMT": 1000, "NOP": 100}
    assert [x["samples"] for x in k["instructions"]] == [5, 30, 10, 55]
    assert k["instructions"][3]["stalls"] == {"barrier": 55, "wait": 0}
    ncu.source_table([str(path)], top=3)
    out = capsys.readouterr().out
    assert "0.0 M warp instructions executed; by opcode: FMNMX 45.5%, PRMT 45.5%" in out
    assert "hot loops: 2 instructions, 0.0 M executed, 40.0% of samples; wait 100%" in out
    assert "rest: 2 instructions, 0.0 M executed, 60.0% of samples; barrier 92%, wait 8%" in out
    assert out.index("#3") < out.index("#1") < out.index("#2")
    bad = tmp_path / "raw.csv"
    bad.write_text('"ID","Kernel Name"\n"","ms"\n')
    with pytest.raises(ValueError, match="no 'Kernel Name' row"):
        ncu.source_kernels(str(bad))
    assert "--provider 'flash': accepted: triton, cudnn, gluon-TILES" in refused(
        ncu.main, ["forward", "--provider", "flash"], capsys)
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    assert "--provider 'gluon-12x3': gluon-TILES with TILES expected BLOCK_MxBLOCK_NxSTAGES" in refused(
        ncu.main, ["forward", "--provider", "gluon-12x3"], capsys)


def test_train_tuner_picks_adds_candidate_tiles_and_names_a_bad_one(monkeypatch, capsys):
    """``--add`` appends a tile (with a register cap) to the named tuner's list before the command runs; a
    forward tile goes into both forward tuners; a malformed value stops with a message naming it."""
    tool = load("tools/train_tuner_picks")
    from stableflash.attention.triton import op
    before = {k: list(op.TUNERS[k].configs) for k in ("fwd", "fwd_tma", "dkdv", "dq")}
    try:
        seen = []
        monkeypatch.setattr(tool, "cli_main", lambda argv: seen.append([len(c) for c in
                                                                       (op.TUNERS[k].configs for k in before)]) or 0)
        assert tool.main(["--add", "dkdv=32x64x4x3r128", "--add", "fwd=64x64x4x2r96", "bench", "attention"]) == 0
        assert seen == [[len(before["fwd"]) + 1, len(before["fwd_tma"]) + 1, len(before["dkdv"]) + 1,
                         len(before["dq"])]]
        added = op.TUNERS["dkdv"].configs[-1]
        assert (added.kwargs, added.num_warps, added.num_stages, added.maxnreg) == (
            {"BLOCK_M": 32, "BLOCK_N": 64}, 4, 3, 128)
        assert op.TUNERS["fwd_tma"].configs[-1].kwargs == {"BLOCK_M": 64, "BLOCK_N": 64, "TMA": False}
        assert op.TUNERS["fwd"].configs[-1].maxnreg == 96
        with pytest.raises(SystemExit, match=r"'dq=64x64x4': expected KERNEL=BMxBNxWARPSxSTAGES\[rREGS\]"):
            tool.main(["--add", "dq=64x64x4", "bench", "attention"])
    finally:
        for k, configs in before.items():
            op.TUNERS[k].configs[:] = configs
    capsys.readouterr()


def test_interleaved_bench_names_bad_arguments_and_summarises_rounds(capsys, monkeypatch):
    """benchmarks/tools/interleaved_bench.py: a malformed shape, rounds or replay time below one, both
    causal switches, one provider or a repeated one, or an unknown provider is refused (exit 2) with
    the argument named; well-formed arguments without a GPU stop at the GPU check. ``summary``: medians
    over the rounds, the first provider's median over each one's, each round's ratio, and the
    stabilization's cost where both stableflash providers were timed (None otherwise)."""
    import torch
    tool = load("tools/interleaved_bench")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, named in ((["--shape", "8,16,2048"], "argument --shape: shape '8,16,2048' is invalid"),
                        (["--rounds", "0"], "--rounds 0"), (["--rep-ms", "-5"], "--rep-ms -5"),
                        (["--both", "--no-causal"], "--both and --no-causal"),
                        (["--providers", "stableflash"], "two or more different providers"),
                        (["--providers", "stableflash", "stableflash"], "two or more different providers"),
                        (["--providers", "nope", "stableflash"], "argument --providers: provider 'nope' is unknown"),
                        ([], "needs a CUDA GPU")):
        assert named in refused(tool.main, argv, capsys), argv
    row = tool.summary((2, 4, 256, 64), True, {"sdpa-default": [1.0, 1.2, 1.1], "stableflash": [0.9, 1.5, 1.0]})
    assert row["median_ms"] == {"sdpa-default": 1.1, "stableflash": 1.0}
    assert row["ratio_to_first"]["stableflash"] == pytest.approx(1.1) and row["ratio_to_first"]["sdpa-default"] == 1.0
    assert row["per_round"]["stableflash"] == pytest.approx([1.0 / 0.9, 1.2 / 1.5, 1.1 / 1.0])
    assert row["stabilization_cost"] is None
    row = tool.summary((2, 4, 256, 64), True, {"sdpa-default": [1.0, 1.0, 1.0], "stableflash": [1.03, 1.05, 1.04],
                                               "stableflash-none": [1.0, 0.99, 1.01]})
    assert row["stabilization_cost"] == pytest.approx(1.04 / 1.0 - 1)


def test_interleaved_bench_turns_the_providers_order_each_round(monkeypatch):
    """benchmarks/tools/interleaved_bench.py's ``time_rounds`` with ``time_one`` stood in for (no GPU): each
    round times every provider once, the order turned by one each round, and each provider's times come
    back in round order."""
    from stableflash.bench import attention
    tool = load("tools/interleaved_bench")
    visits = []

    def time_one(provider, shape, mode, cfg, dtype, device, gen):
        visits.append(provider)
        return float(len(visits))
    monkeypatch.setattr(attention, "time_one", time_one)
    providers = ["sdpa-default", "stableflash", "stableflash-none"]
    times = tool.time_rounds((2, 4, 256, 64), True, providers, rounds=4, rep_ms=1, gen=None)
    assert visits == ["sdpa-default", "stableflash", "stableflash-none", "stableflash", "stableflash-none",
                      "sdpa-default", "stableflash-none", "sdpa-default", "stableflash", "sdpa-default",
                      "stableflash", "stableflash-none"]
    assert times == {"sdpa-default": [1.0, 6.0, 8.0, 10.0], "stableflash": [2.0, 4.0, 9.0, 11.0],
                     "stableflash-none": [3.0, 5.0, 7.0, 12.0]}


def test_round_order_puts_each_case_in_each_place_once_over_as_many_rounds():
    """``stableflash.bench.rounds.round_order``: over any n rounds in a row each of n cases is visited once a
    round and once in each place; round 0 keeps the given order; no cases is refused naming the argument."""
    from stableflash.bench.rounds import round_order
    cases = ["a", "b", "c", "d"]
    assert round_order(cases, 0) == cases and round_order(cases, 1) == ["b", "c", "d", "a"]
    for start in range(9):
        orders = [round_order(cases, start + r) for r in range(len(cases))]
        assert all(sorted(order) == cases for order in orders)
        assert all(sorted(order[place] for order in orders) == cases for place in range(len(cases)))
    assert round_order(("x",), 5) == ["x"]
    with pytest.raises(ValueError, match="cases is empty"):
        round_order([], 0)


def test_forward_timeline_names_bad_arguments_and_sums_the_phases(capsys, monkeypatch):
    """benchmarks/tools/forward_timeline.py: a head_dim other than 64 or 128, malformed or non-persistent
    tiles are refused (exit 2) with the argument named; well-formed arguments without a GPU stop at the GPU
    check. ``summarise``: per phase the events, summed and mean ``dur`` and the share of all phases; a trace
    without the phases is an error naming what it holds."""
    pytest.importorskip("triton.experimental.gluon")
    import torch
    tool = load("tools/forward_timeline")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, named in ((["--shape", "8,16,2048,96"], "--shape 8,16,2048,96 is invalid"),
                        (["--tiles", "128x128"], "--tiles 128x128 is invalid"),
                        (["--tiles", "128x128x2p"], "accepted: persistent tiles"),
                        ([], "needs a Hopper GPU")):
        assert named in refused(tool.main, argv, capsys), argv
    events = [{"name": "q_wait", "ph": "X", "dur": 1.0}, {"name": "q_wait", "ph": "X", "dur": 3.0},
              {"name": "full_blocks", "ph": "X", "dur": 12.0}, {"name": "epilogue", "ph": "X", "dur": 4.0},
              {"name": "process_name", "ph": "M"}, {"name": "epilogue", "ph": "i", "dur": 99.0}]
    summary = tool.summarise({"traceEvents": events})
    assert list(summary) == list(tool.PHASES)
    assert summary["q_wait"] == {"events": 2, "total": 4.0, "mean": 2.0, "share": 0.2}
    assert summary["full_blocks"]["share"] == 0.6 and summary["epilogue"]["total"] == 4.0
    assert summary["first_block"] == {"events": 0, "total": 0.0, "mean": 0.0, "share": 0.0}
    with pytest.raises(ValueError, match="no events named q_wait.*'kernel': 1"):
        tool.summarise({"traceEvents": [{"name": "kernel", "ph": "X", "dur": 5.0}]})


def test_ab_kernels_runs_a_command_on_both_trees_in_rounds(tmp_path):
    """benchmarks/tools/ab_kernels.sh with AB_CMD: the command runs ROUNDS times in the order A B A B,
    A importing the given source tree and B the working tree's src/, each run's output kept under $OUT."""
    import os
    import shlex
    import shutil
    import subprocess
    import sys
    repo = BENCHMARKS.parent
    old = tmp_path / "old"
    shutil.copytree(repo / "src" / "stableflash", old / "stableflash",
                    ignore=shutil.ignore_patterns("__pycache__"))
    cmd = f'{shlex.quote(sys.executable)} -c "import stableflash; print(stableflash.__file__)"'
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OUT=str(tmp_path / "out"), AB_CMD=cmd, ROUNDS="2", TAIL="1")
    done = subprocess.run(["bash", str(BENCHMARKS / "tools" / "ab_kernels.sh"), str(old)], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    heads = [line for line in done.stdout.splitlines() if line.startswith("== round")]
    assert heads == [f"== round {r}, {side}: {old if side == 'A' else repo / 'src'}" for r in (1, 2) for side in "AB"]
    for r in (1, 2):
        assert (tmp_path / "out" / f"ab-A-{r}.txt").read_text().strip() == str(old / "stableflash" / "__init__.py")
        assert (tmp_path / "out" / f"ab-B-{r}.txt").read_text().strip() == str(repo / "src" / "stableflash" /
                                                                                  "__init__.py")


def test_host_overhead_profiles_the_stabilized_paths(monkeypatch):
    """benchmarks/tools/host_overhead.py --profile: ``profile_paths`` takes the stabilized provider's
    function from ``providers()`` (whose entries hold the function and two switches) and writes one
    cProfile section per timed path, each counting the calls; the paths stubbed by Python functions so
    that no GPU is needed."""
    import torch
    tool = load("tools/host_overhead")
    seen = []
    monkeypatch.setattr(tool, "inputs", lambda shape: (torch.zeros(shape),) * 4)
    monkeypatch.setattr(tool, "paths", lambda fn, q, k, v, do: {name: (lambda name=name: seen.append(name))
                                                                   for name in tool.PATHS})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    text = tool.profile_paths((1, 1, 8, 64), calls=3)
    for name in tool.PATHS:
        assert f"== {name}, 3 calls" in text
        assert seen.count(name) == 20 + 3                    # 20 warm-up calls, then the profiled ones


def test_host_overhead_breakdown_sums_each_parts_inclusive_time_and_restores_it(monkeypatch):
    """benchmarks/tools/host_overhead.py --breakdown: ``breakdown`` wraps module functions and a class's
    static methods, sums their inclusive wall time over the timed calls only (not the 20 warm-up ones),
    and puts the originals back, also when a call raises."""
    import sys
    import time
    import types
    tool = load("tools/host_overhead")
    mod = types.ModuleType("fake_parts")

    class Op:
        @staticmethod
        def run(x):
            time.sleep(0.001)
            return mod.helper(x) + 1

    def helper(x):
        time.sleep(0.002)
        return x

    mod.Op, mod.helper = Op, helper
    monkeypatch.setitem(sys.modules, "fake_parts", mod)
    targets = [("fake_parts", "Op.run"), ("fake_parts", "helper")]
    original_run = Op.__dict__["run"]
    parts = tool.breakdown(lambda: mod.Op.run(1), lambda out: mod.helper(out), calls=5, targets=targets)
    assert list(parts) == ["forward call", "torch.autograd.grad", "Op.run", "helper"]
    # per call: Op.run 1 ms of its own + the helper's 2 ms; the helper in forward and backward, 2 × 2 ms. Had
    # the 20 warm-up calls been counted, each figure would be 5 times as large: the bounds leave room for a
    # loaded machine's late wake-ups below that
    assert 3000 <= parts["Op.run"] < 3000 + 9000
    assert 4000 <= parts["helper"] < 4000 + 12000
    assert parts["forward call"] >= parts["Op.run"]
    assert Op.__dict__["run"] is original_run and mod.helper is helper
    with pytest.raises(ZeroDivisionError):
        with tool.summed(targets, {}):
            raise ZeroDivisionError
    assert Op.__dict__["run"] is original_run and mod.helper is helper


def test_host_overhead_breakdown_names_functions_that_exist():
    """Every function ``--breakdown`` times in the project resolves (a renamed one would stop the tool on
    the GPU); Triton's launcher functions are taken only where they resolve, and a missing module or
    attribute does not."""
    tool = load("tools/host_overhead")
    assert [t for t in tool.BREAKDOWN if not tool._resolves(*t)] == []
    assert not tool._resolves("no_such_module_here", "f")
    assert not tool._resolves("stableflash.attention.triton.launch_cache", "Plan.no_such_method")
    assert tool._resolves("stableflash.attention.triton.launch_cache", "Plan.__call__")


@pytest.mark.parametrize("argv, named", [(["--shape", "1,2"], "--shape"), (["--shape", "1,a,3,4"], "--shape"),
                                         (["--shape", "1,0,8,64"], "--shape"), (["--calls", "0"], "--calls")])
def test_host_overhead_refuses_bad_arguments_naming_them_before_asking_for_a_gpu(argv, named, capsys):
    tool = load("tools/host_overhead")
    with pytest.raises(SystemExit) as stop:
        tool.main(argv)
    assert stop.value.code == 2 and named in capsys.readouterr().err


def test_train_interleaved_names_bad_arguments_and_pairs_each_round(capsys, monkeypatch):
    """benchmarks/tools/train_interleaved.py: one attention (without --without-plans, --without-graphs or --without-route)
    or a repeated one,
    an unknown spec, fewer than four rounds, a batch or warm-up below one and an unknown compile mode are
    refused (exit 2) naming the argument; well-formed arguments without a GPU stop at the GPU check.
    ``paired_summary``: each case's medians, and the first case's step over its own in the same round,
    median and quartiles."""
    import torch
    tool = load("tools/train_interleaved")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, named in ((["--attention", "triton"], "two or more different attentions"),
                        (["--attention", "sdpa", "--attention", "sdpa"], "two or more different attentions"),
                        (["--attention", "sdpa", "--attention", "nope"], "--attention entry 'nope'"),
                        (["--rounds", "3"], "--rounds 3"), (["--batch-size", "0"], "--batch-size 0"),
                        (["--warmup", "0"], "--warmup 0"), (["--compile-mode", "fast"], "--compile-mode 'fast'"),
                        ([], "needs a CUDA GPU"), (["--attention", "triton", "--without-plans"], "needs a CUDA GPU"),
                        (["--attention", "triton", "--without-route"], "needs a CUDA GPU"),
                        (["--attention", "triton", "--without-graphs"], "needs a CUDA GPU"),
                        (["--attention", "triton", "--forward-min-keys", "1024"], "needs a CUDA GPU"),
                        (["--forward-min-keys", "0"], "--forward-min-keys 0")):
        assert named in refused(tool.main, argv, capsys), argv
    walls = {"sdpa": [10.0, 12.0, 11.0, 20.0, 10.0], "triton": [12.5, 12.0, 22.0, 25.0, 11.0]}
    issues = {"sdpa": [9.0, 9.5, 9.0, 9.0, 9.0], "triton": [12.0, 11.0, 11.0, 11.0, 11.0]}
    table = tool.paired_summary(walls, issues)
    assert table["sdpa"]["paired_ratio_median"] == 1.0 and table["sdpa"]["paired_ratio_quartiles"] == [1.0, 1.0]
    ratios = sorted(a / b for a, b in zip(walls["sdpa"], walls["triton"]))
    assert table["triton"]["paired_ratio_median"] == pytest.approx(ratios[2])
    q1, q3 = table["triton"]["paired_ratio_quartiles"]
    assert ratios[0] <= q1 <= ratios[2] <= q3 <= ratios[4]
    assert table["triton"]["median_ms"] == 12.5 and table["triton"]["issue_median_ms"] == 11.0
    assert "issue_phase_medians_ms" not in table["triton"]
    phases = {"sdpa": [[4.0, 3.0, 2.0], [5.0, 3.5, 1.0], [4.5, 3.0, 1.5], [4.0, 4.0, 1.0], [4.0, 3.0, 2.0]],
              "triton": [[6.0, 4.0, 2.0], [5.0, 5.0, 1.0], [5.0, 5.0, 1.0], [5.0, 5.0, 1.0], [5.0, 5.0, 1.0]]}
    split = tool.paired_summary(walls, issues, phases)["sdpa"]["issue_phase_medians_ms"]
    assert split == {"forward": 4.0, "backward": 3.0, "clip and optimizer": 1.5}


def test_train_interleaved_builds_and_steps_each_case_under_its_own_route_settings(monkeypatch):
    """benchmarks/tools/train_interleaved.py's ``build_steps`` and ``run_rounds`` with the training step
    stood in for (no GPU): the "route off" case's model is built and stepped with ``route.ENABLED``
    False, the "forward routed from N keys" case's with ``FORWARD_MIN_KEYS[(64, True)]`` = N and the
    other thresholds as they are, every other case with the route as shipped; the "plans off" and "graphs
    off" cases step the last attention's model with ``launch_cache.PLANS`` or ``GRAPHS`` False, every
    other case with both on; the "launches stood in for" and "op bodies stood in for" cases (models of their
    own) step with ``Replay.__call__`` (graphs off), or ``op._forward`` and ``op._backward_impl``, replaced,
    every other case and every warm-up with the real ones; the route's settings, both switches and the
    stood-in functions are restored after building and after the rounds."""
    import torch
    from stableflash.attention.gluon import route
    from stableflash.attention.triton import launch_cache
    from stableflash.bench import training
    from stableflash.attention.triton import op
    tool = load("tools/train_interleaved")
    replay_call, forward, backward = launch_cache.Replay.__call__, op._forward, op._backward_impl
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    import torch._functorch.config as functorch_config            # build_steps switches its AOT cache off
    monkeypatch.setattr(functorch_config, "enable_autograd_cache", functorch_config.enable_autograd_cache)
    shipped = dict(route.FORWARD_MIN_KEYS)
    seen = []                      # (spec, build number, ENABLED, FORWARD_MIN_KEYS, PLANS, GRAPHS) at each step

    def training_step(spec, cfg, device):
        build = sum(1 for s in seen if s[0] == spec and s[1] == "built")
        seen.append((spec, "built", build))
        def step(marks=None):
            seen.append((spec, build, route.ENABLED, dict(route.FORWARD_MIN_KEYS), launch_cache.PLANS,
                         launch_cache.GRAPHS, launch_cache.Replay.__call__ is replay_call,
                         op._forward is forward and op._backward_impl is backward))
            if marks is not None:                                  # the forward, then the backward, issued
                marks += [time.perf_counter(), time.perf_counter()]
        return step, None
    monkeypatch.setattr(training, "training_step", training_step)
    cfg = tool.TrainBenchConfig(attentions=("sdpa", "triton"), batch_size=1, compile=False, warmup=2)
    steps = tool.build_steps(["sdpa", "triton"], cfg, without_plans=True, without_route=True, forward_min_keys=1024,
                             without_graphs=True, host_parts=True)
    assert list(steps) == ["sdpa", "triton", "triton, plans off", "triton, graphs off",
                           "triton, launches stood in for", "triton, op bodies stood in for", "triton, route off",
                           "triton, forward routed from 1024 keys"]
    assert route.ENABLED and route.FORWARD_MIN_KEYS == shipped          # restored after building
    earlier = {**shipped, (64, True): 1024}
    want = {("sdpa", 0): (True, shipped), ("triton", 0): (True, shipped), ("triton", 1): (True, shipped),
            ("triton", 2): (True, shipped), ("triton", 3): (False, shipped), ("triton", 4): (True, earlier)}
    steps_seen = [s for s in seen if s[1] != "built"]
    assert len(steps_seen) == 6 * cfg.warmup                            # six models built, each warmed up
    assert all(s[-2] and s[-1] for s in steps_seen)                     # warmed up with nothing stood in for
    for spec, build, enabled, keys, *_ in steps_seen:
        assert (enabled, keys) == want[(spec, build)], (spec, build)
    seen.clear()
    walls, issues, phases = tool.run_rounds(steps, rounds=3)
    for case in steps:                                                  # the phases add up to the issue time
        assert len(walls[case]) == len(issues[case]) == len(phases[case]) == 3
        for issue, split in zip(issues[case], phases[case]):
            assert len(split) == 3 and min(split) >= 0 and sum(split) == pytest.approx(issue, abs=1e-9)
    assert route.ENABLED and route.FORWARD_MIN_KEYS == shipped and launch_cache.PLANS   # restored after the rounds
    assert launch_cache.GRAPHS and launch_cache.Replay.__call__ is replay_call
    assert op._forward is forward and op._backward_impl is backward
    assert len(seen) == 3 * 8
    cases = list(steps)
    stepped = [case for index in range(3) for case in cases[index:] + cases[:index]]   # turned by one a round
    for (spec, build, enabled, keys, plans, graphs, real_launches, real_bodies), case in zip(seen, stepped):
        assert (enabled, keys) == want[(spec, build)], case
        assert plans == (case != "triton, plans off"), case
        assert graphs == (case not in ("triton, graphs off", "triton, launches stood in for")), case
        assert real_launches == (case != "triton, launches stood in for"), case
        assert real_bodies == (case != "triton, op bodies stood in for"), case


def test_train_interleaved_stands_in_for_the_launches_or_the_op_bodies(monkeypatch):
    """``stood_in``: "launches" — a replay builds its arguments and launches nothing; "bodies" — ``op._forward``
    and ``op._backward_impl`` are host_overhead's stand-ins, which only allocate outputs of the real ones'
    shapes; both restored after the block, also after an error inside it."""
    import torch
    from stableflash.attention.triton import launch_cache, op
    from stableflash.attention.triton.launch import stabilized_config
    tool = load("tools/train_interleaved")
    calls = []

    class Replay:
        values = lambda self, tensors: calls.append(("values", tuple(tensors)))  # noqa: E731
    monkeypatch.setattr(launch_cache.Replay, "__call__", lambda self, grid, tensors, stream=None: calls.append("run"))
    real_call = launch_cache.Replay.__call__
    with tool.stood_in("launches"):
        launch_cache.Replay.__call__(Replay(), (1, 1, 1), [1, 2])
    assert calls == [("values", (1, 2))] and launch_cache.Replay.__call__ is real_call
    ran = []
    monkeypatch.setattr(op, "_forward", lambda *args: ran.append("forward"))
    monkeypatch.setattr(op, "_backward_impl", lambda *args: ran.append("backward"))
    real_forward, real_backward = op._forward, op._backward_impl
    config = stabilized_config(torch.bfloat16)
    q = torch.zeros(1, 2, 8, 4, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 6, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="inside"):
        with tool.stood_in("bodies"):
            o, lse, o32 = op._forward(q, k, k, True, 0.5, config)
            assert o.shape == q.shape and lse.shape == (1, 2, 8) and lse.dtype == torch.float32
            dq, dk, dv = op._backward_impl(o, q, k, k, o, o32, lse, True, 0.5, config)
            assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)
            raise RuntimeError("inside")
    assert ran == [] and op._forward is real_forward and op._backward_impl is real_backward
    with tool.stood_in(None):
        assert op._forward is real_forward


def test_carry_triton_packs_keeps_and_unpacks_a_stripped_tree_in_parts(tmp_path, capsys):
    """benchmarks/tools/carry_triton.py without a registry or GPU: a stand-in wheel tree loses what the
    kernels never use (the AMD backend, CUPTI, proton's library) and keeps the NVIDIA tools executable; cut
    into parts, kept folder by folder and unpacked, it is the stripped tree file for file; a missing part,
    a changed part and bad arguments are errors that name them."""
    tool = load("tools/carry_triton")
    root = tmp_path / "wheel"
    import random
    gen = random.Random(0)                                  # incompressible contents: the parts are many
    noise = lambda n: bytes(gen.getrandbits(8) for _ in range(n))  # noqa: E731
    files = {"triton/__init__.py": b"__version__ = '9.9.9'\n", "triton/backends/nvidia/bin/ptxas": noise(600),
             "triton/backends/nvidia/bin/ptxas-blackwell": noise(900),
             "triton/backends/amd/lib/libtriton_amd_codegen.so": b"x" * 900,
             "triton/backends/nvidia/lib/cupti/libcupti.so": b"y" * 900, "triton/_C/libproton.so": b"z" * 900}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    removed = tool.strip_tree(root)
    assert sorted(removed) == ["triton/_C/libproton.so", "triton/backends/amd", "triton/backends/nvidia/lib/cupti"]
    assert all((root / "triton/backends/nvidia/bin" / t).stat().st_mode & 0o111 for t in ("ptxas", "ptxas-blackwell"))
    out = tmp_path / "parts"
    meta = tool.write_parts(root, out, "9.9.9", part_bytes=400, preset=0)
    assert meta["release"] == "9.9.9" and len(meta["parts"]) >= 3
    assert all((out / str(i + 1) / name).stat().st_size <= 400 for i, name in enumerate(meta["parts"]))
    kept = tmp_path / "kept"
    tool.keep(out / "1", kept)
    with pytest.raises(ValueError, match=r"parts \['part-01'.*are not kept"):
        tool.unpack(kept)
    for i in range(2, len(meta["parts"]) + 1):
        tool.keep(out / str(i), kept)
    site, env = tool.unpack(kept)
    assert site == kept / "9.9.9" and env["TRITON_BACKENDS_IN_TREE"] == "1"
    assert env["PYTHONPATH"].split(":")[0] == str(site)
    got = sorted(str(p.relative_to(site)) for p in site.rglob("*") if p.is_file())
    assert got == ["triton/__init__.py", "triton/backends/nvidia/bin/ptxas", "triton/backends/nvidia/bin/ptxas-blackwell"]
    for rel in got:
        assert (site / rel).read_bytes() == files[rel]
    assert (site / "triton/backends/nvidia/bin/ptxas-blackwell").stat().st_mode & 0o111
    changed = kept / "parts" / "part-01"
    changed.write_bytes(b"\0" + changed.read_bytes()[1:])
    with pytest.raises(ValueError, match="do not match their SHA-256"):
        tool.unpack(kept)
    with pytest.raises(SystemExit):
        tool.main(["keep", str(tmp_path / "nowhere")])
    assert "is not a folder; accepted: a carried folder of parts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.main(["pack", "--part-mb", "0"])
    assert "--part-mb 0.0 is invalid; accepted: a positive number of MB" in capsys.readouterr().err


def test_ptxas_streams_hashes_instructions_and_groups_streams(monkeypatch):
    """``ptxas_streams``: a listing's hash leaves addresses out and sees an instruction's change; ``streams``
    counts the assemblies of each stream, most frequent first, each summarised once."""
    ps = load("tools/ptxas_streams")
    one = "        /*0000*/                   MOV R1, c[0x0][0x28] ;\n        /*0010*/      HGMMA.64x64x16 ;\n"
    moved = one.replace("/*0010*/", "/*0020*/")
    other = one.replace("R1,", "R2,")
    assert ps.instruction_hash(one) == ps.instruction_hash(moved) != ps.instruction_hash(other)
    assert len(ps.instruction_hash(one)) == 10
    from stableflash.attention.gluon import sass
    listings = {b"a": one, b"b": other, b"c": moved}
    monkeypatch.setattr(sass, "disassemble", lambda cubin: (listings[cubin], ""))
    monkeypatch.setattr(ps, "_summary", lambda cubin: {"first": cubin.decode()})
    got = ps.streams([b"b", b"a", b"c"])
    assert list(got.values()) == [{"count": 2, "first": "a"}, {"count": 1, "first": "b"}]


def test_ptxas_streams_split_puts_each_stream_in_a_copy_of_the_cache(monkeypatch, tmp_path, capsys):
    """``split``: each backward kernel's PTX in a cache is re-assembled; copy K holds each kernel's K-th stream
    (the drawn one first, a kernel with fewer streams keeps its last), the rest of the cache copied as it is."""
    ps = load("tools/ptxas_streams")
    from stableflash.attention.gluon import sass
    cache = tmp_path / "cache"
    runs_of = {"ptx-half": [b"h1", b"h2", b"h2", b"h1", b"h2"], "ptx-full": [b"f1", b"f1", b"f1", b"f1", b"f1"]}
    for folder, ptx, drawn in (("aa", "ptx-half", b"h1"), ("bb", "ptx-full", b"f1")):
        (cache / folder).mkdir(parents=True)
        (cache / folder / "attn_bwd_hopper_kernel.ptx").write_text(ptx)
        (cache / folder / "attn_bwd_hopper_kernel.cubin").write_bytes(drawn)
        (cache / folder / "attn_bwd_hopper_kernel.json").write_text("{}")
    asked = []
    monkeypatch.setattr(ps, "assemble", lambda ptx, runs, jobs=1: asked.append((runs, jobs)) or runs_of[ptx][:runs])
    monkeypatch.setattr(sass, "disassemble", lambda cubin: (f"        /*0000*/  {cubin.decode()} ;\n", ""))
    monkeypatch.setattr(ps, "_summary", lambda cubin: {"ex2": len(cubin)})
    monkeypatch.setattr(sass, "tools_present", lambda: True)
    ps.main(["split", str(cache), "--runs", "5", "--jobs", "3", "--out", str(tmp_path / "out")])
    assert asked == [(5, 3), (5, 3)]
    read = lambda k, folder: (tmp_path / "out" / f"stream-{k}" / folder / "attn_bwd_hopper_kernel.cubin").read_bytes()
    assert [read(0, "aa"), read(1, "aa"), read(0, "bb"), read(1, "bb")] == [b"h1", b"h2", b"f1", b"f1"]
    assert (tmp_path / "out" / "stream-1" / "bb" / "attn_bwd_hopper_kernel.json").read_text() == "{}"
    got = json.loads((tmp_path / "out" / "streams.json").read_text())
    h1, h2, f1 = (ps.instruction_hash(f"        /*0000*/  {c} ;") for c in ("h1", "h2", "f1"))
    assert got["kernels"]["aa"] == {h1: {"runs": 2, "drawn": True, "copies": [0], "ex2": 2},
                                    h2: {"runs": 3, "drawn": False, "copies": [1], "ex2": 2}}
    assert got["kernels"]["bb"] == {f1: {"runs": 5, "drawn": True, "copies": [0, 1], "ex2": 2}}
    assert "(drawn)" in capsys.readouterr().out
    err = refused(ps.main, ["split", str(tmp_path / "none"), "--out", str(tmp_path / "o")], capsys)
    assert f"cache {str(tmp_path / 'none')!r} is not a folder" in err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no attn_bwd_hopper_kernel.cubin in"):
        ps.main(["split", str(tmp_path / "empty"), "--out", str(tmp_path / "o")])


def test_ptxas_streams_refuses_bad_input(capsys, tmp_path):
    """Bad --shape, --runs or --attempts name the argument, the value and what is accepted; ``draw`` without a
    compute-capability-9.0 GPU says so."""
    ps = load("tools/ptxas_streams")
    assert "--shape '1,2,3': expected B,H,N,d" in refused(ps.main, ["draw", "--shape", "1,2,3", "--out", str(tmp_path)],
                                                            capsys)
    assert "d 64 or 128" in refused(ps.main, ["draw", "--shape", "1,2,128,96", "--out", str(tmp_path)], capsys)
    assert "--runs: '0': expected an integer ≥ 1" in refused(ps.main, ["survey", "--runs", "0"], capsys)
    assert "--attempts: 'x'" in refused(ps.main, ["draw", "--shape", "1,2,128,64", "--attempts", "x", "--out",
                                                  str(tmp_path)], capsys)
    import torch
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        err = refused(ps.main, ["draw", "--shape", "1,2,128,64", "--out", str(tmp_path)], capsys)
        assert "compute capability 9.0" in err


def _attention_step(ms: dict, fwd_ms: dict, checks: dict) -> dict:
    """A `bench attention` file of one shape: ``ms`` / ``fwd_ms`` map providers to fwd+bwd / fwd times."""
    rows = [{"shape": [32, 12, 1024, 64], "mode": mode, "provider": p, "ms": t, "tflops": 100.0 / t}
            for mode, times in (("fwd+bwd", ms), ("fwd", fwd_ms)) for p, t in times.items()]
    return {"env": {"gpu": "G", "torch": "T", "triton": "R"}, "checks": checks, "rows": rows}


def _train_step(ref_ms: float, ours_ms: float, ratio: float) -> dict:
    case = lambda ms, r: {"median_ms": ms, "issue_median_ms": ms / 2, "paired_ratio_median": r,  # noqa: E731
                          "paired_ratio_quartiles": [r - 0.01, r + 0.01]}
    return {"cases": {"sdpa": case(ref_ms, 1.0), "triton": case(ours_ms, ratio)}}


def test_speed_summary_computes_the_ratios_from_the_steps_that_finished(tmp_path, capsys):
    """speed_summary.py: the fwd+bwd ratios (SDPA's default and SDPA flash over ours, the portable path's),
    the stabilization's cost, the forward's ratio, the largest error ratio against each peer, the training
    steps' rows, and the steps not finished named; a folder that is not one refused."""
    ss = load("tools/speed_summary")
    checks = {"stableflash": {"O": 2.0e-3, "dQ": 2.4e-3}, "sdpa-default": {"O": 1.6e-3, "dQ": 2.5e-3},
              "sdpa-flash": {"O": 2.0e-3, "dQ": 3.0e-3}}
    step = _attention_step({"stableflash": 1.0, "stableflash-none": 0.8, "stableflash-portable": 1.25,
                            "sdpa-default": 1.05, "sdpa-flash": 1.5}, {"stableflash": 0.5, "sdpa-default": 0.45}, checks)
    (tmp_path / "attention-causal-32x12x1024x64.json").write_text(json.dumps(step))
    (tmp_path / "train-b4-graphs.json").write_text(json.dumps(_train_step(11.5, 11.4, 1.003)))
    assert ss.main([str(tmp_path)]) == 0
    got = json.loads((tmp_path / "summary.json").read_text())
    case = got["attention"]["causal 32x12x1024x64"]
    assert case["fwd+bwd"]["vs_cudnn"] == pytest.approx(1.05)
    assert case["fwd+bwd"]["vs_fa2"] == pytest.approx(1.5)
    assert case["fwd+bwd"]["cost"] == pytest.approx(0.25)
    assert case["fwd+bwd"]["portable_vs_cudnn"] == pytest.approx(0.84)
    assert case["fwd"]["vs_cudnn"] == pytest.approx(0.9)
    assert case["error_ratio"]["sdpa-default"] == {"max": pytest.approx(1.25), "at": "O"}
    assert case["error_ratio"]["sdpa-flash"] == {"max": pytest.approx(1.0), "at": "O"}
    assert got["training"]["train-b4-graphs"]["ours"]["paired_ratio_median"] == 1.003
    assert "attention-no-mask-4x16x8192x128" in got["missing"] and "bench-train" in got["missing"]
    assert "train-b4-graphs" not in got["missing"] and len(got["missing"]) == 9 + 4 + 1
    text = capsys.readouterr().out
    assert text.strip() == (tmp_path / "summary.md").read_text().strip()
    assert "| 32×12×1024×64 | causal | 100 | 125 | 80 | 95 | 67 | – | – | – | +25.0% | 1.050 | 1.50 | 0.84 |" in text
    assert "| CUDA graphs (reduce-overhead), batch 4 | 11.50 | 11.40 | 1.003 (0.993–1.013) | 5.75 / 5.70 |" in text
    assert "sdpa-default 1.250, sdpa-flash 1.000" in text
    err = refused(ss.main, [str(tmp_path / "nowhere")], capsys)
    assert "nowhere' is not a directory; accepted: a speed_tables.sh output folder" in err


def _fake_python(tmp_path: Path) -> Path:
    """An executable standing in for python in speed_tables.sh: it records each command's arguments (one
    JSON list a line in calls.jsonl), writes a minimal result where the command names one (--out, --json),
    fails where FAKE_FAIL is one of its arguments' substrings, and runs speed_summary.py for real."""
    fake = tmp_path / "fakepy"
    fake.write_text(f"""#!{sys.executable}
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
if args and args[0].endswith("speed_summary.py"):
    os.execv({sys.executable!r}, [{sys.executable!r}, *args])
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
if os.environ.get("FAKE_FAIL") and any(os.environ["FAKE_FAIL"] in a for a in args):
    sys.exit(1)
for flag in ("--out", "--json"):
    if flag in args:
        path = Path(args[args.index(flag) + 1])
        if path.name.startswith("train-"):
            body = {json.dumps(_train_step(10.0, 9.9, 1.01))!r}
        else:
            body = json.dumps({{"rows": [], "checks": {{}}}})
        path.write_text(body)
""")
    fake.chmod(0o755)
    return fake


def test_speed_tables_runs_each_step_once_and_goes_on_where_it_stopped(tmp_path):
    """speed_tables.sh: each step's command (the README's), a progress line per step run, a failed step run
    again and a finished one skipped on the next run of the same folder, the summary after; bad arguments
    refused with what is accepted."""
    import os
    import subprocess
    script = BENCHMARKS / "tools" / "speed_tables.sh"
    log = tmp_path / "calls.jsonl"
    steps = "attention-no-mask-8x16x2048x128 train-b16-compiled bench-train"
    env = {**os.environ, "SPEED_PYTHON": str(_fake_python(tmp_path)), "FAKE_LOG": str(log), "SPEED_STEPS": steps,
           "FAKE_FAIL": "--batch-size"}
    out = tmp_path / "out"
    first = subprocess.run(["bash", str(script), str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[0] == ["-m", "stableflash.cli", "bench", "attention", "--no-causal", "--shape", "8,16,2048,128",
                        "--providers", "stableflash", "stableflash-none", "stableflash-portable", "sdpa-default",
                        "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex", "--modes", "fwd", "fwd+bwd", "--timing",
                        "graph", "--layout", "bnhd", "--out", str(out / "attention-no-mask-8x16x2048x128.json")]
    assert calls[1] == ["benchmarks/tools/train_interleaved.py", "--batch-size", "16", "--rounds", "30", "--json",
                        str(out / "train-b16-compiled.json")]
    assert calls[2] == ["-m", "stableflash.cli", "bench", "train", "--attention", "sdpa", "--attention", "triton",
                        "--attention", "triton stabilize=none", "--out", str(out / "bench-train.json")]
    progress = [line.split()[:2] for line in (out / "progress").read_text().splitlines()]
    assert progress == [["attention-no-mask-8x16x2048x128", "0"], ["train-b16-compiled", "1"], ["bench-train", "0"]]
    assert "Not finished:" in first.stdout and "train-b16-compiled" in (out / "summary.md").read_text()
    second = subprocess.run(["bash", str(script), str(out)], env={**env, "FAKE_FAIL": ""}, capture_output=True,
                            text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert "attention-no-mask-8x16x2048x128: done before, skipped" in second.stdout
    assert len(log.read_text().splitlines()) == 4                 # the failed step alone ran again
    assert (out / "progress").read_text().splitlines()[-1].startswith("train-b16-compiled 0 ")
    assert "| compiled, batch 16 | 10.00 | 9.90 | 1.010 (1.000–1.020) |" in (out / "summary.md").read_text()
    for argv, extra, message in (([], {}, "usage: bash benchmarks/tools/speed_tables.sh OUT_DIR"),
                                 ([str(out)], {"SPEED_STEPS": "nope"}, "SPEED_STEPS names 'nope'; accepted: "),
                                 ([str(out)], {"SPEED_STEP_TIMEOUT": "soon"},
                                  "SPEED_STEP_TIMEOUT=soon is invalid; accepted: a positive number of seconds")):
        bad = subprocess.run(["bash", str(script), *argv], env={**env, **extra}, capture_output=True, text=True,
                             timeout=60)
        assert bad.returncode == 2 and message in bad.stderr, (argv, bad.stderr)
    fresh = tmp_path / "never"                                     # refused before the folder is made
    bad = subprocess.run(["bash", str(script), str(fresh)], env={**env, "SPEED_STEPS": "attention-causal-32,12,1024,64"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "accepted: attention-causal-32x12x1024x64 " in bad.stderr and not fresh.exists()
