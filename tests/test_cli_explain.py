"""The `stableflash explain-add` command."""
import json
import subprocess
import sys

import pytest

from stableflash.cli import main

PAPER = ["explain-add", "-2.4071154594421387", "-2.296875"]


def test_paper_example_text(capsys):
    assert main(PAPER) == 0
    out = capsys.readouterr().out
    for needle in ("-4.703990459442139", "-4.71875", "1100000010010111", "-0.014759540557861328"):
        assert needle in out, needle


def test_json_output(capsys):
    assert main(PAPER + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["result"] == -4.71875
    assert d["bits"] == "1100000010010111" and d["error"] == -0.014759540557861328


def test_formats_are_passed_through(capsys):
    assert main(["explain-add", "65504", "65504", "--fmt", "fp16", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fmt"] == "fp16" and d["result"] == float("inf")
    assert main(["explain-add", "1", "2", "--fmt", "e4m3", "--acc", "bf16", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["fmt"], d["acc"], d["result"]) == ("fp8_e4m3", "bf16", 3.0)


def test_bad_format_exits_2_without_traceback(capsys):
    with pytest.raises(SystemExit) as info:
        main(PAPER + ["--fmt", "bf17"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "'bf17'" in err and "Traceback" not in err


def test_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["explain-add", "--help"])
    assert info.value.code == 0
    assert "--acc" in capsys.readouterr().out


def test_module_entry_point_takes_negative_operands():
    proc = subprocess.run([sys.executable, "-m", "stableflash.cli", *PAPER],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "-4.71875" in proc.stdout and "1100000010010111" in proc.stdout
