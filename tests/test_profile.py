"""A profile of chosen steps: JAX's profiler trace of exactly those steps, readable by
XProf's converter, and the step's compiled program unchanged by it."""

import glob
import json
import os
import re

import optax
import pytest

import redray
from redray.engine.profile import PROFILE_ENV, profile_window
from tiny import TinyLM, lm_collate, lm_loss, token_data

DATA = token_data(40)  # 5 steps per epoch at batch 8


def trainer(**kw):
    return redray.Trainer.of(lambda rngs: TinyLM(rngs), lm_collate, lm_loss, optax.adam(1e-2),
                          batch_size=8, progress=False, checkpoint=False, **kw)


def step_runs(folder: str) -> list[float]:
    """The start times (µs) of the training step's runs on the host in a trace folder,
    read through XProf's own converter (what its trace viewer shows)."""
    from xprof.convert import raw_to_tool_data

    planes = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
    assert len(planes) == 1, planes
    data, content_type = raw_to_tool_data.xspace_to_tool_data(planes, "trace_viewer", {})
    assert content_type == "application/json"
    events = json.loads(data)["traceEvents"]
    # the host's record of each run of the compiled step (one per optimizer step; each
    # device's own are named "[i] ...")
    return sorted(e["ts"] for e in events
                  if e.get("ph") == "X" and e.get("name", "").endswith("(jit_train_step)")
                  and not e["name"].startswith("["))


def instructions(compiled) -> str:
    """A compiled program's text without where in Python each instruction was traced:
    the tables of files, functions and stack frames, and each instruction's metadata.
    Those name the line and column of whoever asked for the program (two calls on one
    line differ in column) where the persistent cache had not handed both the one
    program compiled first."""
    text = compiled.as_text()
    text = re.sub(r"\n\nFileNames\n.*?\nStackFrames\n(?:\d+ \{[^}]*\}\n)*", "\n", text,
                  flags=re.S)
    assert "FileLocations" not in text and "stack_frame_id=" in text
    return re.sub(r", metadata=\{[^}]*\}", "", text)


def test_a_profile_traces_exactly_the_steps_asked_for_and_changes_no_program(tmp_path, capsys):
    plain = trainer()
    plain.fit(DATA, max_steps=1)
    profiled = trainer(profile=(2, 4), profile_dir=str(tmp_path / "prof"))
    profiled.fit(DATA, epochs=2, max_steps=6)
    folder = str(tmp_path / "prof" / "host0")
    assert profiled._hooks.run.profile_trace == folder
    # steps 2, 3 and 4 (of 6): their three calls, none of the others'
    assert len(step_runs(folder)) == 3
    assert f"profiled steps 2-4 on every host: {tmp_path / 'prof'}" in capsys.readouterr().out
    # the profiled Trainer's step is the same compiled program as the plain one's
    assert instructions(profiled.compiled_step()) == instructions(plain.compiled_step())


def test_a_window_past_the_budget_stops_at_the_fits_end_and_the_variable_sets_one(
        tmp_path, monkeypatch):
    monkeypatch.setenv(PROFILE_ENV, "3:9")
    t = trainer(profile_dir=str(tmp_path))
    t.fit(DATA, max_steps=4)  # steps 3 and 4 of the window 3-9
    assert t._profile.traced == (3, 4)
    assert len(step_runs(t._hooks.run.profile_trace)) == 2


@pytest.mark.parametrize("value", [(0, 2), (3, 2), (1,), "a:b", 1.5, (1, 2.0), (True, 2)])
def test_a_bad_profile_says_what_to_give(value):
    with pytest.raises(ValueError, match=r"profile=.*give the optimizer steps to trace as "
                                         r"profile=\(first, last\)"):
        trainer(profile=value)


def test_a_window_as_text():
    assert profile_window("10:12") == (10, 12)
    assert profile_window("7") == (7, 7)
    assert profile_window(None) is None and profile_window("") is None
