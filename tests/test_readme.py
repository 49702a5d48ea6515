"""Every code block of README.md and of the pages under docs/ runs, or names the test
that covers it; the site they make builds; the API reference names every public name.

The pages are read in the site's order: README.md (the home page), then the pages of
mkdocs.yml's nav, then any other page under docs/.

* ``python`` blocks run in that order as one program (like a notebook's cells), in a
  subprocess with 4 simulated CPU devices so that Ray and JAX state stay out of pytest.
* ``bash`` blocks: every command line runs, in the same working folder, after the
  Python blocks (whose runs the commands inspect), unless COVERED_ELSEWHERE names the
  test that runs it (a remote cluster, the whole suite).
* ``text`` blocks are pictures; the layout's (docs/contributing.md) may only name paths
  that exist.

Any other block, or a changed line the tables no longer know, fails, so the pages
cannot drift from the code. The only edits to their text before it runs are the
placeholders in SUBSTITUTIONS.
"""

import ast
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUT = "docs/contributing.md"  # the page whose text block is the layout

# (placeholder in the README, what the test puts there, why)
SUBSTITUTIONS = [
    ("/abs/path/runs", "{work}/runs", "the reader's absolute storage folder"),
    ("/path/to/checkpoint", "{work}/tiny-llama",
     "a Hugging Face checkpoint: a tiny random LLaMA written by transformers + torch, with "
     "GPT-2's tokenizer"),
    ("/path/to/out", "{work}/exported", "the folder save_pretrained writes"),
    ("--port 5000", "--port {port}", "a free port rather than MLflow's default"),
    ("make demo   # creates .venv if missing, installs, runs the main job",
     "make -s -C {root} demo DEMO_ARGS='--size tiny --steps 6 --storage {work}/runs'",
     "the demo at a tiny size, into the storage the later commands read (the README's "
     "`redray run` line then resumes it)"),
]

# Command lines that cannot run here, exactly as the README writes them -> the test
# that runs them.
# The clusters guide's laptop-to-cluster walkthrough (its bash block), run line by line against a
# separately started head by tests/test_cluster_submit.py.
WALKTHROUGH = (
    "ray start --head --dashboard-host 0.0.0.0 --num-cpus 8",
    "scp HEAD:~/.ray/auth_token ~/.ray/auth_token",
    "redray submit examples/language_modeling/train.py --address http://HEAD:8265 --python "
    "/opt/venv/bin/python -- --size tiny --steps 4 --storage /shared/runs --name walkthrough",
    "redray submit examples/language_modeling/train.py --address http://HEAD:8265 --python "
    "/opt/venv/bin/python --no-wait -- --size tiny --steps 8 --storage /shared/runs --name "
    "walkthrough",
    "redray logs JOB --address http://HEAD:8265 --follow",
    "redray status JOB --address http://HEAD:8265",
    "redray runs /shared/runs",
)

COVERED_ELSEWHERE = {
    "make test   # same set-up, then the test suite (CPU only; 36 to 55 minutes on 2 cores "
    "over the last runs)":
        "tests/test_readme.py::test_make_test_installs_then_runs_the_whole_suite",
    "make bench-check   # every benchmark script at a tiny size: each still runs (about 7 min)":
        "tests/test_readme.py::test_make_test_installs_then_runs_the_whole_suite",
    "make test-fast   # the inner loop: lint + all but the Ray-cluster and slow tiers "
    "(about 10 min)":
        "tests/test_readme.py::test_make_test_fast_lints_then_leaves_out_the_ray_and_slow_tiers",
    "redray submit train.py --address http://HEAD:8265 -- --steps 500  # as a Ray job; "
    "streams logs":
        "tests/test_cluster_submit.py::test_redray_submit_streams_the_job_and_returns_its_status",
    **{line: "tests/test_cluster_submit.py::"
                   "test_the_readme_walkthrough_runs_against_a_head_with_token_auth"
       for line in WALKTHROUGH},
    "redray logs JOB --address http://HEAD:8265 --follow   # also: redray status JOB, redray "
    "stop JOB":
        "tests/test_cluster_submit.py::"
        "test_a_missing_module_names_python_and_jobs_are_followed_stopped_and_listed",
}

# What the README's program computed, read back from its namespace at the end: name ->
# a Python expression in the README's own names.
PROBES = {
    "evals": "[r for r in history if 'eval_loss' in r]",
    "outputs": "[int(o) for o in outputs]",
    "labels": "[e['label'] for e in test]",
    "cluster_evals": "[r for r in result.history if 'eval_loss' in r]",
    "cluster_predictions": "[int(p) for p in result.predictions]",
    "resumed_from_step": "resumed.resumed_from_step",
    "resumed_checkpoint": "resumed.checkpoint",
    "resumed_eval_loss": "[r for r in resumed.history if 'eval_loss' in r][-1]['eval_loss']",
    "loaded_eval_loss": "tuned.evaluate(test)['loss']",
    "loaded_predictions": "[int(p) for p in predictor.predict(test)]",
    "tuned_predictions": "[int(p) for p in tuned.predictor().predict(test)]",
    "override_plan": "trainer.placement()",
    "override_plan_line": "trainer.plan.describe()",
    "maml_losses": "[r['loss'] for r in maml_history]",
    "generated_shape": "list(np.asarray(tokens).shape)",
    "sampled": "[(len(c.tokens), len(c.logprobs), c.finish_reason) for c in done]",
    "loss_before_tuning": "float(lm_loss(model, {'ids': np.stack([r['ids'] for r in counting])},"
                          " None, False))",
    "loss_after_tuning": "tuner.evaluate(counting)['loss']",
    "private_accuracy": "private_history[-1]['eval_accuracy']",
    "lora_sizes": "[adapted.describe()[k] for k in ('trainable_parameters', 'parameters')]",
    "lora_state": "sorted({p.rsplit('/', 1)[-1] for p in redray.sharding.flatten("
                  "adapted.state.params)[0]})",
    "lora_loss": "adapted.evaluate(counting)['loss']",
    "merged_loss": "float(lm_loss(merged, {'ids': np.stack([r['ids'] for r in counting])},"
                   " None, False))",
    "merged_names": "sorted({p for p in redray.sharding.flatten(nnx.state(merged))[0]"
                    " if 'lora' in p})",
    "words": "[words.rows, words.documents, words.packing_efficiency]",
    "streamed_losses": "[r['loss'] for r in streamed_history if 'loss' in r]",
    "schedule_text": "repr(lr)",
    "plans": "[axes.abstract(64).shape, shared.parallelism.describe()]",
    "schedule_steps": "[r['step'] for r in longer_history if 'loss' in r]",
    "hook_best": "best.best",
    "profiled_steps": "[len(step_spans), profiled.step]",
    "capitals": "scores",
    "tracked": "[sorted(tracked.trackers), [r['failure'] for r in tracked.trackers.values()],"
               " tracked.trackers['wandb']['run_id'] in tracked.summary()]",
    "hook_evals": "[r['eval_loss'] for r in watched_history if 'eval_loss' in r]",
    "looped": "[looped.value, looped.checkpoint, looped.resumed_from_step]",
    "looped_logged": "[(m.step, round(m.value, 6)) for m in __import__('mlflow').MlflowClient("
                     "looped.tracking_uri).get_metric_history(looped.mlflow_run_id,"
                     " 'test_accuracy')]",
}

KNOWN_LANGUAGES = {"python", "bash", "text", "console"}
FENCE = re.compile(r"^( *)```(\S*)\s*$")


@dataclasses.dataclass
class Block:
    language: str
    line: int            # the page's line number of the block's first code line
    indent: int
    lines: list
    page: str = "README.md"  # relative to the repository's root

    def where(self, i: int = 0) -> str:
        return f"{self.page}:{self.line + i}"


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    blocks, current = [], None
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if current is None:
            if fence:
                current = Block(fence[2], number + 1, len(fence[1]), [], page)
        elif fence and not fence[2] and len(fence[1]) == current.indent:
            blocks.append(current)
            current = None
        else:
            current.lines.append(line[current.indent:])
    assert current is None, f"{page}:{current.line - 1}: a code block is never closed"
    return blocks


def nav_pages(nav) -> list[str]:
    """The Markdown files of a mkdocs nav, in its order."""
    out = []
    for entry in nav:
        for value in (entry.values() if isinstance(entry, dict) else [entry]):
            out += nav_pages(value) if isinstance(value, list) else [value]
    return out


def pages() -> list[str]:
    """README.md, then docs/'s pages in the site's order (README.md and BENCHMARKS.md
    are published as the site's index.md and benchmarks.md: see docs/hooks.py)."""
    import yaml

    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        nav = yaml.load(f, Loader=yaml.BaseLoader)["nav"]
    ordered = ["README.md"] + [f"docs/{p}" for p in nav_pages(nav)
                               if p not in ("index.md", "benchmarks.md")]
    every = sorted(os.path.relpath(os.path.join(d, f), ROOT)
                   for d, _, files in os.walk(os.path.join(ROOT, "docs"))
                   for f in files if f.endswith(".md"))
    return ordered + [p for p in every if p not in ordered]


def readme():
    """The pages' text, joined, and their blocks in order."""
    texts, blocks = [], []
    for page in pages():
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        texts.append(text)
        blocks += readme_blocks(text, page)
    return "\n".join(texts), blocks


def command_lines(blocks) -> list[tuple[int, str]]:
    """(page:line, line) of every command in the bash blocks, in order."""
    out = []
    for block in blocks:
        if block.language != "bash":
            continue
        for i, line in enumerate(block.lines):
            if line.strip() and not line.lstrip().startswith("#"):
                assert not line.rstrip().endswith("\\"), \
                    f"{block.where(i)}: write each command on one line"
                out.append((block.where(i), line.strip()))
    return out


def substitute(line: str, work: dict) -> str:
    for placeholder, replacement, _ in SUBSTITUTIONS:
        line = line.replace(placeholder, replacement.format(**work))
    return line


# ------------------------------------------------------------------ fast checks
def test_every_block_is_run_or_covered():
    text, blocks = readme()
    for block in blocks:
        assert block.language in KNOWN_LANGUAGES, (
            f"{block.where(-1)}: a ```{block.language or '(no language)'} block: "
            f"tests/test_readme.py runs {sorted(KNOWN_LANGUAGES)} blocks only")
    lines = [line for _, line in command_lines(blocks)]
    for line, test in COVERED_ELSEWHERE.items():
        assert line in lines, f"COVERED_ELSEWHERE names a line the pages no longer have: {line!r}"
        path, name = test.split("::")
        with open(os.path.join(ROOT, path)) as f:
            functions = {n.name for n in ast.walk(ast.parse(f.read()))
                         if isinstance(n, ast.FunctionDef)}
        assert name in functions, f"{line!r} is said to be covered by {test}, which does not exist"
    for placeholder, _, _ in SUBSTITUTIONS:
        assert placeholder in text, f"SUBSTITUTIONS names {placeholder!r}, which the pages lack"
    assert any(b.language == "python" for b in blocks)


def test_the_layout_names_only_paths_that_exist():
    _, blocks = readme()
    layouts = [b for b in blocks if b.language == "text" and b.page == LAYOUT]
    assert layouts, f"{LAYOUT} has no layout block"
    for block in layouts:
        for i, line in enumerate(block.lines):
            if not line.strip() or line.startswith(" "):
                continue  # a description's continuation
            paths = []
            for word in line.split():
                if "/" not in word:
                    break
                paths.append(word)
            assert paths, f"{block.where(i)}: a layout line must start with a path"
            for path in paths:
                assert os.path.exists(os.path.join(ROOT, path)), \
                    f"{block.where(i)}: {path} does not exist"


def test_the_readme_is_short_and_links_the_guides():
    """The README is the home page: at most 300 lines, linking every guide of the nav."""
    import yaml

    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert len(text.splitlines()) <= 300, "README.md: keep it at most 300 lines; move " \
        "the rest into a guide under docs/"
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        nav = yaml.load(f, Loader=yaml.BaseLoader)["nav"]
    guides = next(entry["Guides"] for entry in nav if "Guides" in entry)
    for guide in nav_pages(guides):
        assert f"](docs/{guide})" in text, f"README.md does not link docs/{guide}"


def test_the_api_reference_names_every_public_name():
    """docs/reference.md has an entry (``::: module.name``, rendered by mkdocstrings) for
    each name of ``redray.__all__``, and each entry names the object redray exports."""
    import importlib

    import redray

    with open(os.path.join(ROOT, "docs", "reference.md")) as f:
        text = f.read()
    entries = re.findall(r"^::: ([\w.]+)$", text, re.M)
    documented = []
    for path in entries:
        module, name = path.rsplit(".", 1)
        documented.append(getattr(importlib.import_module(module), name))
    for name in redray.__all__:
        if name == "__version__":
            assert "`redray.__version__`" in text
            continue
        assert any(obj is getattr(redray, name) for obj in documented), \
            f"docs/reference.md has no entry for redray.{name}"


def test_the_console_sample_is_what_the_console_prints():
    """A ```console block is what the driver shows; its progress and evaluation lines
    are rebuilt from their numbers by the console's own formatting."""
    from redray.engine.console import progress_text, row_text

    _, blocks = readme()
    samples = [line for b in blocks if b.language == "console" for line in b.lines]
    assert samples
    for line in samples:
        progress = re.match(r"step (\d+)/(\d+) \(\d+%\) \| epoch (\d+) \| loss ([\d.]+) \| "
                            r"([\d.]+) steps/s \| ([\d,]+) tokens/s", line)
        if progress:
            step, total, epoch, loss, speed, tokens = progress.groups()
            row = {"step": int(step), "epoch": int(epoch), "loss": float(loss),
                   "steps_per_s": float(speed), "tokens_per_s": float(tokens.replace(",", ""))}
            assert progress_text(row, int(total)) == line
        evaluation = re.match(r"step (\d+) \| epoch (\d+) \| eval_loss ([\d.]+)$", line)
        if evaluation:
            step, epoch, value = evaluation.groups()
            assert row_text({"step": int(step), "epoch": int(epoch),
                             "eval_loss": float(value)}) == line
        assert progress or evaluation or line.startswith("redray: "), line


def recipe(target: str) -> list[str]:
    """The commands ``make TARGET`` would run, printed by ``make -n -B`` (none run)."""
    done = subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


# What the Makefile gives the tiers without Ray (see its comment).
FAST_COMPILE = ("--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0 "
                "--xla_llvm_disable_expensive_passes=true")


def test_make_test_installs_then_runs_the_whole_suite():
    """`make test` (the whole suite, about 50 minutes on 2 cores) cannot run inside the
    suite: its recipe is checked instead: install, lint, build the documentation site
    strictly, then every test but the benchmark scripts' tiny runs (those without Ray in 2
    processes, then those marked alone in one of their own, then the Ray ones: every test
    is in exactly one of the three selections); `make bench-check` runs the tiny runs, in
    two parts."""
    commands = recipe("test")
    install = next(i for i, c in enumerate(commands) if 'pip install -q -e ".[test]"' in c)
    lint = next(i for i, c in enumerate(commands) if c.endswith("-m ruff check ."))
    site = next(i for i, c in enumerate(commands) if "-m mkdocs build --strict" in c)
    fast = next(i for i, c in enumerate(commands)
                if c.endswith('-m pytest -q -n 2 -m "not ray and not bench and not alone" '
                              '--durations=20')
                and f"XLA_FLAGS='{FAST_COMPILE}'" in c)
    alone = next(i for i, c in enumerate(commands)
                 if c.endswith('-m pytest -q -m "alone and not ray and not bench" --durations=5')
                 and f"XLA_FLAGS='{FAST_COMPILE}'" in c
                 and "JAX_ENABLE_COMPILATION_CACHE=false" in c)
    rest = next(i for i, c in enumerate(commands)
                if c.endswith('-m pytest -q -m "ray and not bench" --durations=20'))
    assert install < lint < site < fast < alone < rest
    commands = recipe("bench-check")
    lint = next(i for i, c in enumerate(commands) if c.endswith("-m ruff check ."))
    one = next(i for i, c in enumerate(commands) if c.endswith(
        '-m pytest -q -n 2 -m "bench and not ray" tests/test_benchmarks.py'))
    other = next(i for i, c in enumerate(commands) if c.endswith(
        '-m pytest -q -m "bench and ray" tests/test_benchmarks.py'))
    assert lint < one < other


def test_make_test_fast_lints_then_leaves_out_the_ray_and_slow_tiers():
    commands = recipe("test-fast")
    lint = next(i for i, c in enumerate(commands) if c.endswith("-m ruff check ."))
    suite = next(i for i, c in enumerate(commands)
                 if c.endswith('-m pytest -q -n 2 -m "not slow and not ray"')
                 and f"XLA_FLAGS='{FAST_COMPILE}'" in c)
    assert lint < suite


# ------------------------------------------------------------------ running it
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from hf_tiny import llama_folder

    folder = tmp_path_factory.mktemp("readme")
    os.symlink(os.path.join(ROOT, "examples"), folder / "examples")  # commands name them
    from hf_tiny import gpt2_tokenizer

    llama_folder(folder / "tiny-llama", tokenizer=gpt2_tokenizer())  # evaluation reads text
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    return {"work": str(folder), "port": free_port(), "env": env, "root": ROOT}


RUNNER = """
import json, sys
sources, probes, out = sys.argv[1:]
namespace = {"__name__": "__main__"}
for source, page in json.loads(sources):
    exec(compile(open(source).read(), page, "exec"), namespace)
with open(out, "w") as f:
    json.dump({k: eval(v, namespace) for k, v in json.loads(probes).items()}, f)
"""


@pytest.fixture(scope="module")
def program(work):
    """Runs the Python blocks as one program, page after page in one namespace, whose
    line numbers are each page's (a traceback names the page and its line)."""
    _, blocks = readme()
    sources = []
    for page in dict.fromkeys(b.page for b in blocks if b.language == "python"):
        with open(os.path.join(ROOT, page)) as f:
            lines = [""] * len(f.read().splitlines())
        for block in (b for b in blocks if b.language == "python" and b.page == page):
            for i, line in enumerate(block.lines):
                lines[block.line - 1 + i] = substitute(line, work)
        source = os.path.join(work["work"], page.replace("/", "_") + ".py")
        with open(source, "w") as f:
            f.write("\n".join(lines) + "\n")
        sources.append((source, os.path.join(ROOT, page)))
    out = os.path.join(work["work"], "probes.json")
    done = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(sources), json.dumps(PROBES),
                           out],
                          cwd=work["work"], env=work["env"], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    with open(out) as f:
        return json.load(f)


@pytest.mark.slow
@pytest.mark.ray
def test_the_python_blocks_run_and_do_what_they_say(program, work):
    labels = np.array(program["labels"])
    evals = {r["step"]: r for r in program["evals"]}
    assert sorted(evals) == [14, 28, 42, 56, 70] and evals[70]["eval_accuracy"] > 0.95
    outputs = np.array(program["outputs"])
    assert len(outputs) == len(labels)
    np.testing.assert_allclose(np.mean(outputs == labels), evals[70]["eval_accuracy"])

    # one Parallelism value: a Trainer built from it, and the same plan on 64 devices
    assert program["plans"] == [{"stage": 1, "data": 16, "fsdp": 2, "expert": 1, "context": 1,
                                 "model": 2},
                                "data=1 x fsdp=2 x model=2"]

    # redray.fit on 2 simulated hosts x 2 devices: the same batches, so the same eval as
    # the one process after 2 epochs; predictions come back one per input, in order
    cluster = program["cluster_evals"][-1]
    assert cluster["step"] == 28
    np.testing.assert_allclose(cluster["eval_loss"], evals[28]["eval_loss"], rtol=1e-5)
    predictions = np.array(program["cluster_predictions"])
    assert len(predictions) == len(labels)
    np.testing.assert_allclose(np.mean(predictions == labels), cluster["eval_accuracy"])
    # asking the finished run for a third epoch resumes it and trains only that epoch
    assert program["resumed_from_step"] == 28
    assert program["resumed_checkpoint"] == f"{work['work']}/runs/points/checkpoints/42"
    # load_params and load_model read that last checkpoint
    np.testing.assert_allclose(program["loaded_eval_loss"], program["resumed_eval_loss"],
                               rtol=1e-5)
    assert program["loaded_predictions"] == program["tuned_predictions"]

    specs = {row[0]: row[2] for row in (re.split(r"\s{2,}", line)
                                         for line in program["override_plan"].splitlines())
             if len(row) == 4}
    assert specs["out/kernel"] == "()"  # the override
    assert specs["hidden/kernel"] == "(None, 'model')"  # the automatic spec stays elsewhere
    # the plan that trainer runs, in the line the console prints and MLflow tags
    assert program["override_plan_line"] == \
        "data=2 x fsdp=1 x model=2, batch 64 = 32 per device x 1 accumulation steps"

    assert program["generated_shape"] == [2, 8]
    # the evaluation guide: the local task scored, its accuracy one of 0, 1/2 and 1
    assert set(program["capitals"]) == {"capitals"}
    assert program["capitals"]["capitals"]["acc"] in (0.0, 0.5, 1.0)
    # the profiling guide: the trace of steps 5-7 holds three runs of the step, of 14
    assert program["profiled_steps"] == [3, 14]
    # the tracking guide: three trackers, none failed, the W&B run named in the summary
    assert program["tracked"] == [["mlflow", "tensorboard", "wandb"], [None] * 3, True]
    # the sampler's completions: at most each request's length, EOS or not
    for (n, logprobs, reason), most in zip(program["sampled"], [8, 4, 8, 4, 6]):
        assert 1 <= n <= most and logprobs == n
        assert reason == "eos" or (reason, n) == ("length", most)
    # a loss that splits the NNX model for an inner gradient step trains
    assert program["maml_losses"][-1] < 0.9 * program["maml_losses"][0], program["maml_losses"]
    assert program["loss_after_tuning"] < program["loss_before_tuning"]
    from safetensors.numpy import load_file

    # DP-SGD still learns the quadrants under clipping and noise
    assert program["private_accuracy"] > 0.9
    # LoRA: only the adapters train (A and B of q and v in each of the 2 layers), the
    # loss falls below the base model's, and merging keeps what the adapters learned
    trained, total = program["lora_sizes"]
    assert program["lora_state"] == ["lora_a", "lora_b"] and 0 < trained < total / 10
    assert program["lora_loss"] < program["loss_before_tuning"]
    np.testing.assert_allclose(program["merged_loss"], program["lora_loss"], rtol=1e-4)
    assert program["merged_names"] == []
    # a corpus tokenized and packed through Ray Data, then streamed: every document
    # kept, rows mostly real tokens, and the LM learns its counting pattern
    rows, documents, efficiency = program["words"]
    assert documents == 96 and efficiency > 0.95 and rows > 100
    streamed = program["streamed_losses"]  # one mean per log window
    assert len(streamed) >= 4 and streamed[-1] < 0.5 * streamed[0]
    # a schedule over the budget: the resumed run grew it from 20 to 40 steps
    assert "over 40 steps; budget 40 from step 20 (reached from" in program["schedule_text"]
    # the epoch (14 steps) ends at 28, then windows of 10
    assert program["schedule_steps"] == [28, 38, 40]
    # a hook hears every logged row, the evaluations' too
    assert len(program["hook_evals"]) == 2 and program["hook_best"] == min(program["hook_evals"])
    # redray.run: 4 rounds of 7 steps on 2 hosts, each round's metric logged once
    assert program["looped"] == [28, f"{work['work']}/runs/rounds/checkpoints/28", None]
    assert [step for step, _ in program["looped_logged"]] == [7, 14, 21, 28]
    assert all(0.5 < value <= 1.0 for _, value in program["looped_logged"])

    written = load_file(os.path.join(work["work"], "exported", "model.safetensors"))
    original = load_file(os.path.join(work["work"], "tiny-llama", "model.safetensors"))
    assert written.keys() == original.keys()
    for name, value in original.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)


def quiet_console(out: str, err: str) -> list[str]:
    """The lines a run showed, checked to be the quiet default's."""
    lines = (out + err).splitlines()
    assert not [x for x in lines if "Traceback" in x or "Warning" in x or "WARNING" in x], lines
    # nothing came through Ray's stream of the hosts' output ("(Host pid=..)")
    assert not [x for x in lines if "pid=" in x or x.startswith("(raylet)")], lines
    return lines


def last_numbers(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def check_make_demo(work, done):
    """`make demo` (6 steps): a few lines by default (the run's own messages and
    progress), no traceback, no warning, nothing of Ray's worker stream."""
    console = quiet_console(done.stdout, done.stderr)
    # 2 data lines, the plan chosen (and why), the attention kernel, the mesh, 2
    # evaluations, 1 progress line (log_every=10 > 6 steps), the perplexities (3 lines)
    # and the summary (4)
    assert len(console) == 15, console
    assert [x for x in console if x.startswith("step 6/6 (100%) | epoch 0 | loss ")], console
    assert console[2].startswith("plan: data=") and "runner-up" in console[2], console
    assert console[3].startswith("attention: "), console  # on CPU: xla or chunked
    assert "tokens/s | ETA 0s" in done.stdout and console[4].startswith("redray: 2 host(s)")
    numbers = last_numbers(done.stdout)
    assert numbers["step"] == 6 and numbers["perplexity_after"] < numbers["perplexity_before"]
    runs = os.path.join(work["work"], "runs")
    assert f"checkpoint:    {runs}/demo/checkpoints/6" in done.stdout
    assert f"mlflow ui --backend-store-uri sqlite:///{runs}/mlflow.db" in done.stdout


def check_demo(work, done):
    """The README's `redray run` of the demo (20 steps, verbose through the environment:
    see VERBOSE) resumes the run `make demo` trained to step 6."""
    out = done.stdout + done.stderr
    # verbose: the workers' stream is back, and the start-up table with it
    assert "(Host pid=" in out and "redray: the run took" in out
    assert re.search(r"^  first_step +\d+\.\d\d ", out, re.M), out[-3000:]
    assert "resumed from " in out  # host 0's line, through the workers' stream
    numbers = last_numbers(done.stdout)
    assert numbers["step"] == 20 and numbers["perplexity_after"] < numbers["perplexity_before"]
    assert "at step 6 ->" in done.stdout  # the perplexity "before" is step 6's


def check_plan(work, done):
    out = done.stdout
    picked = [line for line in out.splitlines() if line.startswith("plan: ")]
    if picked:  # the planner: the pick the README quotes, and why the runner-up lost
        assert picked[0].startswith("plan: stage=2 x data=1 x fsdp=16 x model=2, micro 1, "
                                    "remat none, 1f1b (3522.4 ms per step predicted"), out
        assert "runner-up stage=2 x data=1 x fsdp=32 x model=1, micro 1, remat dots, 1f1b" \
            in picked[0], out
        return
    if out.lstrip().startswith("{"):
        ratio = json.loads(out)["ratio"]
    else:
        total = next(r for r in out.splitlines() if r.startswith("total"))
        ratio = {"total": float(total.split()[-1].rstrip("x"))}
    assert all(r <= 1.01 for r in ratio.values()), out
    if "--device-memory" in out or "one training step" in out:
        assert "fits on a device of 80.00 GiB: yes" in out, out


def check_runs(work, done):
    rows = {line.split()[0]: line.split()[1] for line in done.stdout.splitlines()[1:]}
    assert rows == {"demo": "FINISHED", "points": "FINISHED", "rounds": "FINISHED",
                    "tracked": "FINISHED"}, done.stdout  # tracked: the tracking guide's


def check_plot(work, done):
    with open(os.path.join(work["work"], "demo.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def check_export(work, done):
    """The trained run, as Hugging Face safetensors that transformers loads: the
    weights are the run's last checkpoint's."""
    pytest.importorskip("torch")
    import jax
    from transformers import AutoModelForCausalLM

    from redray import load_params
    from redray.models import build, load_config

    exported = os.path.join(work["work"], "hf")
    model, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    params, _ = load_params(os.path.join(work["work"], "runs", "demo"),
                            lambda rngs: build(load_config(exported), rngs=rngs))
    np.testing.assert_array_equal(model.get_input_embeddings().weight.detach().numpy(),
                                  np.asarray(jax.tree.leaves(params["embed_tokens"])[0]))


# command prefix -> what its run must have done, beyond exiting with status 0
CHECKS = {
    "make -s -C": check_make_demo,
    "redray run examples/language_modeling/train.py": check_demo,
    "redray plan": check_plan,
    "redray runs": check_runs,
    "redray plot": check_plot,
    "redray export": check_export,
}
# command prefix -> its environment's REDRAY_VERBOSE: the README's `redray run` of the
# demo runs verbose (the workers' stream shown), every other command quiet (the default).
VERBOSE = {"redray run examples/language_modeling/train.py": "1"}


def serve_and_ask(command: str, work: dict) -> None:
    """Starts a server command, waits until MLflow answers with the README's run on it,
    then stops it (its whole process group)."""
    log = open(os.path.join(work["work"], "server.log"), "w+")
    server = subprocess.Popen(["bash", "-c", command], cwd=work["work"], env=work["env"],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    api = f"http://127.0.0.1:{work['port']}/api/2.0/mlflow"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(
                        f"{api}/experiments/get-by-name?experiment_name=redray", timeout=10) as r:
                    experiment = json.load(r)["experiment"]["experiment_id"]
                break
            except (urllib.error.URLError, OSError):
                log.seek(0)
                assert server.poll() is None, f"{command!r} exited: {log.read()[-3000:]}"
                assert time.monotonic() < deadline, f"{command!r} never answered on {api}"
                time.sleep(0.25)  # a refused connection costs nothing: ask again soon
        request = urllib.request.Request(
            f"{api}/runs/search", data=json.dumps({"experiment_ids": [experiment]}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as r:
            names = {run["info"]["run_name"] for run in json.load(r)["runs"]}
        assert "points" in names, names
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


@pytest.mark.slow
@pytest.mark.ray
def test_the_command_lines_run(program, work):
    _, blocks = readme()
    for where, line in command_lines(blocks):
        if line in COVERED_ELSEWHERE:
            continue
        command = substitute(line, work)
        if command.startswith("mlflow ui"):
            serve_and_ask(command, work)
            continue
        env = {k: v for k, v in work["env"].items() if k != "REDRAY_VERBOSE"}
        env.update({"REDRAY_VERBOSE": v for p, v in VERBOSE.items() if command.startswith(p)})
        done = subprocess.run(["bash", "-c", command], cwd=work["work"], env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, \
            f"{where}: {line}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        for prefix, check in CHECKS.items():
            if command.startswith(prefix):
                check(work, done)
