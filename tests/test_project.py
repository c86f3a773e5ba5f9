"""The README's fresh-machine commands and CI stay in step, and the README example runs."""
import re
from pathlib import Path

import pytest
import torch

from tests.conftest import readme_python_blocks

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Fresh machine", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section)


def test_readme_has_exactly_two_setup_commands():
    cmds = readme_commands()
    assert len(cmds) == 2, cmds
    assert cmds[0].endswith("stableflash repro") and "pytest" in cmds[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == readme_commands()[1]


@pytest.mark.filterwarnings("ignore:backend=.auto. chose")
def test_readme_python_example_runs():
    code = readme_python_blocks()[0]
    code = code.replace("torch.randn(2, 12, 1024, 64", "torch.randn(1, 2, 40, 16")   # keep it quick
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["o"].shape == (1, 2, 40, 16) and torch.isfinite(namespace["o"]).all()


# Product code says what is; dates, campaign letters ("2026-11-23d", "-23f") and run counts ("3 of 3
# seeds") belong in the research notebook (docs/notebook/), beside the figures they qualify.
HISTORY_PATTERNS = {
    "a date": re.compile(r"\b20\d\d-[01]\d(-[0-3]\d)?"),
    "a campaign letter": re.compile(r"(?<![\w.])-?[0-3]\d[a-h]\b(?!['\"])"),
    "a run count": re.compile(r"\b\d+ of (the )?\d+ (runs|seeds|failing|configurations)\b|\ball \d+ runs\b"),
}


def test_source_carries_no_dates_campaign_letters_or_run_counts():
    found = []
    for path in sorted((ROOT / "src" / "stableflash").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for what, pattern in HISTORY_PATTERNS.items():
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {what}: {line.strip()}")
    assert not found, "history belongs in docs/notebook/:\n" + "\n".join(found)


def test_history_patterns_catch_what_they_name():
    assert HISTORY_PATTERNS["a date"].search("until 2026-11-23d")
    assert HISTORY_PATTERNS["a campaign letter"].search("from -23c to -23d")
    assert HISTORY_PATTERNS["a campaign letter"].search("the 23f default")
    assert HISTORY_PATTERNS["a run count"].search("exploded in 3 of 3 seeds")
    assert HISTORY_PATTERNS["a run count"].search("held on all 11 runs")
    assert not HISTORY_PATTERNS["a date"].search("a 2000-step warm-up")
    assert not HISTORY_PATTERNS["a run count"].search("rank 0 of 1 without torchrun")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_relative_link_in_the_docs_resolves():
    """Every ](path) link in README.md and docs/**/*.md names a file or folder that exists."""
    broken = []
    for md in markdown_files():
        text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)          # code blocks hold no links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path = target.split("#", 1)[0]
            if not path or re.match(r"[a-z][a-z0-9+.-]*:", path):             # an anchor or a URL
                continue
            if not (md.parent / path).exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_the_design_map_names_every_module():
    """docs/design.md's map names each module under src/stableflash/ (its file name, or its package's
    folder with the module's stem listed after it)."""
    design = (ROOT / "docs" / "design.md").read_text()
    src = ROOT / "src" / "stableflash"
    missing = [p.relative_to(src).as_posix() for p in sorted(src.rglob("*.py"))
               if p.name != "__init__.py" and p.name not in design and p.stem not in design]
    assert not missing, f"docs/design.md does not name: {missing}"


# A script path named anywhere in the project: a repository-relative path under one of these folders
# ending in .py or .sh (commands in docs, result files' headers, scripts calling each other).
SCRIPT_PATH = re.compile(r"(?<![\w/.-])((?:benchmarks|docs|src|tests)/[\w./-]+\.(?:py|sh))(?!\w)")
TEXT_SUFFIXES = {".md", ".txt", ".json", ".py", ".sh"}


def project_text_files() -> list[Path]:
    files = [ROOT / "README.md", *(ROOT / ".ci").glob("*")]
    for folder in ("benchmarks", "docs", "src", "tests"):
        files += [p for p in sorted((ROOT / folder).rglob("*")) if p.suffix in TEXT_SUFFIXES and p.is_file()]
    return files


def test_every_script_path_named_in_the_project_exists():
    """Every benchmarks/, docs/, src/ or tests/ path of a .py or .sh file that a doc, a result file,
    a script or a test names exists, so that a script moved to another folder leaves no stale command."""
    dangling = []
    for path in project_text_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            dangling += [f"{path.relative_to(ROOT)}:{n}: {m}" for m in SCRIPT_PATH.findall(line)
                         if not (ROOT / m).is_file()]
    assert not dangling, "paths of scripts that do not exist:\n" + "\n".join(dangling)


def test_script_path_pattern_finds_commands_and_skips_other_paths():
    found = SCRIPT_PATH.findall("`python benchmarks/runs/loss_at.py 5000 RUNS`; (docs/notebook/experiments/"
                                "nan_hunt.py). $B/loss_at.py /tmp/benchmarks/x.py benchmarks/results/a.json")
    assert found == ["benchmarks/runs/loss_at.py", "docs/notebook/experiments/nan_hunt.py"]
