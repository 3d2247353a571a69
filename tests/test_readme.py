"""The README stays short, undated and true: its links resolve, its Python runs and its commands print what it shows.

The slow tests run the README's own text against the tiny trained folder of conftest.py, put in place of
the folder the README names (`runs/quickstart`), each in a fresh process in an empty directory.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FOLDER = "runs/quickstart"  # the model folder the README's examples use
MAX_LINES = 250

LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def shell_lines(text: str) -> list[tuple[str, str | None]]:
    """(command, the comment line shown under it or None) for each `vanilla-transformer ...` line of an
    indented code block."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.startswith("    vanilla-transformer "):
            following = lines[i + 1].strip() if i + 1 < len(lines) else ""
            found.append((line.strip(), following[2:] if following.startswith("# ") else None))
    return found


def test_readme_is_short_and_undated():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_LINES, f"README.md has {len(text.splitlines())} lines; at most {MAX_LINES}"
    # A date is only part of a dated report's file name in benchmarks/results/, which the results table links.
    undated = re.sub(r"benchmarks/results/[\w.-]+", "", text)
    assert not re.search(r"\d{4}-\d{2}-\d{2}", undated), "README.md holds a date: it belongs in a report's name"
    assert "UTC" not in text, "README.md holds a time of day: measurements belong in benchmarks/results/"
    assert re.search(r"\]\(benchmarks/results/[\w.-]+-\d{4}-\d{2}-\d{2}-[\w.-]+\)", text), \
        "the results table links the dated report its numbers come from"


def test_readme_s_tested_range_holds_the_installed_releases_and_starts_at_pyproject_s_floor():
    """What the README says was tested is what this run tests: a release outside its range fails here, the day pip
    installs it (raise the range in README.md and docs/compatibility.md once the rest of the suite passes on it)."""
    from importlib.metadata import version

    from packaging.version import Version

    text = " ".join(README.read_text(encoding="utf-8").split())
    floors = dict(re.findall(r'"(transformers|accelerate)>=([\d.]+)', (ROOT / "pyproject.toml").read_text()))
    for package in ("transformers", "accelerate"):
        found = re.search(rf"\b{package} ([\d.]+) to ([\d.]+)", text)
        assert found, f"README.md names no tested range for {package} ('{package} X to Y')"
        oldest, newest = found.groups()
        assert oldest == floors[package], f"README.md's oldest {package} {oldest} is not pyproject.toml's >={floors[package]}"
        installed = version(package)
        assert Version(oldest) <= Version(installed) <= Version(newest), (
            f"{package} {installed} is installed, outside README.md's tested {oldest} to {newest}: "
            "if the suite passes on it, raise the range in README.md and docs/compatibility.md"
        )


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_points_at_a_file(page):
    targets = [t for t in LINK.findall(page.read_text(encoding="utf-8")) if not re.match(r"[a-z]+:|#", t)]
    missing = [t for t in targets if not (page.parent / t.split("#")[0]).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_readme_examples_are_found():
    """The slow tests below read these; a README rewritten without them must not pass them vacuously."""
    text = README.read_text(encoding="utf-8")
    assert len(python_blocks(text)) >= 2
    commands = dict(shell_lines(text))
    assert f'vanilla-transformer translate --model {FOLDER} "Jesus wept."' in commands
    assert any(c.startswith(f"vanilla-transformer attention --model {FOLDER} ") and "--html" in c for c in commands)


def _env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _run(args, cwd, timeout=600):
    result = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, stdin=subprocess.DEVNULL,
                            timeout=timeout)
    assert result.returncode == 0, f"{args} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(python_blocks(README.read_text(encoding="utf-8")))))
def test_readme_python_block_runs(index, hub_tiny_folder, tmp_path):
    code = python_blocks(README.read_text(encoding="utf-8"))[index]
    assert FOLDER in code, "each Python example loads the README's model folder"
    stdout = _run([sys.executable, "-c", code.replace(FOLDER, str(hub_tiny_folder))], cwd=tmp_path)
    assert stdout.strip(), "each Python example prints what it shows"


def _cli(command: str, folder: Path) -> list[str]:
    """The README's command line as arguments, run with this checkout's package and the test folder."""
    args = shlex.split(command.replace(FOLDER, str(folder)))
    assert args[0] == "vanilla-transformer"
    return [sys.executable, "-m", "vanilla_transformer.cli", *args[1:]]


@pytest.mark.slow
def test_readme_translate_command_prints_one_line_per_sentence(hub_tiny_folder, tmp_path):
    command, shown = next((c, s) for c, s in shell_lines(README.read_text(encoding="utf-8"))
                          if c.startswith(f"vanilla-transformer translate --model {FOLDER} "))
    assert shown is not None, "the README shows the translation under the command"
    sentences = [a for a in shlex.split(command) if not a.startswith("-") and a not in ("vanilla-transformer", "translate", FOLDER)]
    stdout = _run(_cli(command, hub_tiny_folder), cwd=tmp_path)
    assert len(stdout.splitlines()) == len(sentences) == 1


@pytest.mark.slow
def test_readme_attention_commands_write_the_explorer_and_the_maps(hub_tiny_folder, tmp_path):
    commands = [c for c, _ in shell_lines(README.read_text(encoding="utf-8"))
                if c.startswith(f"vanilla-transformer attention --model {FOLDER} ")]
    for command in commands:
        _run(_cli(command.split("  #")[0], hub_tiny_folder), cwd=tmp_path)
    page = tmp_path / "explorer.html"
    assert page.read_text(encoding="utf-8").lstrip().lower().startswith("<!doctype html")
    assert len(list((tmp_path / "maps").glob("*.png"))) > 1


def _section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"## {title}\n")
    return text[start:text.index("\n## ", start + 1)]


def _loaded_in_a_fresh_process(folder: Path, cwd: Path, **options) -> tuple[set[str], str]:
    """The module classes `print(model)` shows, and the attention implementation, of `folder` loaded as the README
    says: with transformers alone, so that the folder's copy of the code runs."""
    extra = "".join(f", {key}={value!r}" for key, value in options.items())
    code = ("from transformers import AutoModelForSeq2SeqLM\n"
            f"model = AutoModelForSeq2SeqLM.from_pretrained({str(folder)!r}, trust_remote_code=True{extra})\n"
            "print(model)\nprint('attention:', model.config._attn_implementation)\n")
    stdout = _run([sys.executable, "-c", code], cwd=cwd, timeout=300)
    classes = set(re.findall(r"^\s*(?:\(\w+\): )?([A-Z]\w*)\(", stdout, flags=re.M))
    return classes, stdout.rsplit("attention: ", 1)[1].strip()


@pytest.mark.slow
def test_readme_names_the_classes_print_model_shows_by_default_and_plain(tmp_path, monkeypatch):
    import torch

    from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration

    folder = tmp_path / "model"
    config = VanillaTransformerConfig.from_preset("tiny", vocab_size=40, encoder_layers=1, decoder_layers=1)
    VanillaTransformerForConditionalGeneration(config).save_pretrained(folder)
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))  # the folder's copy, not another test's
    default, default_attention = _loaded_in_a_fresh_process(folder, tmp_path)
    plain, plain_attention = _loaded_in_a_fresh_process(folder, tmp_path, fast_paths=False, attn_implementation="eager")
    assert (default_attention, plain_attention) == ("sdpa", "eager")

    section = _section("How to read the code")
    paragraph = section[section.index("**What a loaded model runs.**"):].split("\n\n")[0]
    named = set(re.findall(r"`([A-Z]\w*)`", paragraph))
    assert named == default ^ plain, "the README names exactly the classes the default and plain models differ by"
    assert {"FusedMultiHeadAttention", "ClosedFormCrossEntropy"} <= default - plain
    assert "(`sdpa`)" in paragraph and 'fast_paths=False, attn_implementation="eager"' in paragraph
    ours = {name for name in plain if not hasattr(torch.nn, name)}
    unnamed = sorted(name for name in ours if f"`{name}`" not in section)
    assert not unnamed, f"print(model) of the plain model shows classes the README's reading list omits: {unnamed}"
