"""The README's fresh-machine commands and CI stay in step, and the README example runs."""
import re
from pathlib import Path

import pytest
import torch

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
    code = (ROOT / "README.md").read_text().split("```python\n", 1)[1].split("```", 1)[0]
    code = code.replace("torch.randn(2, 12, 1024, 64", "torch.randn(1, 2, 40, 16")   # keep it quick
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["o"].shape == (1, 2, 40, 16) and torch.isfinite(namespace["o"]).all()
