"""A host that is alive but stuck: the watchdog stops the job with what it saw, and
``max_failures`` restarts it from the last checkpoint (a real local Ray cluster)."""

import os

import jax
import optax
import pytest

import redray
from tiny import TinyLM, lm_collate, lm_loss, token_data

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ray = pytest.importorskip("ray")

DATA = token_data(96)  # 12 steps of 8


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def sticking_collate(marker):
    """Host 1 blocks forever in its 6th training batch, once (the marker remembers)."""
    def collate(examples):
        if jax.process_index() == 1 and len(examples) == 4:
            count = marker + ".batches"
            seen = int(open(count).read()) if os.path.exists(count) else 0
            with open(count, "w") as f:
                f.write(str(seen + 1))
            if seen == 5 and not os.path.exists(marker):
                open(marker, "w").close()
                import time
                time.sleep(3600)  # alive, never returns: its peer waits in the step
        return lm_collate(examples)
    return collate


def stuck_fit(tmp_path, marker, **kw):
    return redray.fit(lambda rngs: TinyLM(rngs), sticking_collate(marker), lm_loss,
                      optax.adam(1e-2), train_data=DATA, epochs=1, hosts=2,
                      devices_per_host=2, batch_size=8, model_axis=2, log_every=1, seed=0,
                      storage_path=str(tmp_path / "runs"), name="stuck", progress=False,
                      hang_timeout=8, checkpoint=redray.CheckpointConfig(save_every=2), **kw)


def test_a_stuck_host_fails_the_job_with_its_last_progress(tmp_path):
    with pytest.raises(redray.cluster.HostError) as err:
        stuck_fit(tmp_path, str(tmp_path / "stuck"))
    text = str(err.value)
    assert "made no progress for" in text and "hang_timeout=8 s" in text
    assert "its last progress was" in text and "max_failures" in text
    assert "Where this host waits" in text


def test_a_stuck_host_restarts_from_the_last_checkpoint_with_max_failures(tmp_path):
    marker = str(tmp_path / "stuck")
    result = stuck_fit(tmp_path, marker, max_failures=1)
    assert os.path.exists(marker)  # it did get stuck
    assert result.resumed_from_step is not None and 2 <= result.resumed_from_step <= 5
    assert [r["step"] for r in result.history if "loss" in r][-1] == 12


def never_collating(examples):
    """Host 1 never returns from its first collate (the first batch, whose shapes the
    plan is made for): its group never gets going."""
    if jax.process_index() == 1:
        import time
        time.sleep(3600)
    return lm_collate(examples)


def test_a_group_stuck_at_its_start_is_described_then_stopped(tmp_path, monkeypatch, capfd):
    """A group that trains no step: the driver says where each host stands after
    ``START_NOTICE_S``, and the watchdog, whose clock runs from the host's start, stops
    the job with the phase the host was stuck in."""
    from redray.cluster import launch

    monkeypatch.setattr(launch, "START_NOTICE_S", 2.0)
    with pytest.raises(redray.cluster.HostError) as err:
        redray.fit(lambda rngs: TinyLM(rngs), never_collating, lm_loss, optax.adam(1e-2),
                   train_data=DATA, hosts=2, devices_per_host=2, batch_size=8, model_axis=2,
                   storage_path=str(tmp_path / "runs"), name="never", progress=False,
                   hang_timeout=8)
    said = capfd.readouterr().out
    assert "redray: the group of 2 host(s) has trained no step" in said, said
    assert "host 1: the first batch read and collated" in said, said
    text = str(err.value)
    assert "made no progress for" in text and "hang_timeout=8 s" in text
    assert "its last progress was the start-up phase" in text, text
