import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One test session compiles the same small programs many times over (the tiny models'
# steps, in test after test): JAX's persistent compilation cache, in a folder of this
# session's own (made by the first process, inherited by pytest-xdist's workers and by
# every process a test starts), loads a program compiled before instead of compiling it
# again. The runs on a Ray cluster share it too, and the hardware numbers the first
# of them probed (REDRAY_CACHE_DIR, redray.storage): each would otherwise compile and
# probe afresh in its own new storage folder. A clean run starts empty; the folder is
# removed when that first process exits.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="redray-tests-cache-")
    os.environ["REDRAY_CACHE_DIR"] = _cache
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(_cache, "compile_cache")
    os.environ["REDRAY_TESTS_COMPILE_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"]
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

# Each pytest-xdist worker (and the processes its tests start) compiles into a folder of
# its own: two workers compiling the same program wrote and read one cache entry at
# once, and JAX's cache crashed the process (a segmentation fault in
# compilation_cache.put_executable_and_time, then in get_executable_and_time, in two
# clean runs on 2026-12-06 and 2026-12-07).
_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _worker and os.environ.get("REDRAY_TESTS_COMPILE_CACHE") == \
        os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    os.environ["JAX_COMPILATION_CACHE_DIR"] = \
        os.environ["REDRAY_TESTS_COMPILE_CACHE"] + "-" + _worker
    import sys

    if "jax" in sys.modules:  # read at import: set it where jax came first
        sys.modules["jax"].config.update("jax_compilation_cache_dir",
                                         os.environ["JAX_COMPILATION_CACHE_DIR"])
if _worker:
    # The worker itself writes only programs that took a second or more to compile
    # (the processes its tests start still write every one): a program that compiles
    # in under a second gains little from the cache. (Three clean runs crashed in
    # test_post_training's samplers, once in executable.serialize() for the cache,
    # twice in XLA's compile itself: those tests now run in a process of their own,
    # see the Makefile.)
    import jax

    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray instance for one test module (e.g. where Ray Data reads a stream).
    Modules that define their own ``local_ray`` use theirs. Every test's Ray is a new
    local one (``address="local"``): never a cluster ``ray start`` left on the machine
    (a head killed without ``ray stop`` leaves its address in
    /tmp/ray/ray_current_cluster, which a bare ``ray.init()`` would try to join)."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def hopper(monkeypatch):
    """No GPU here: JAX asks the installed cuDNN for its version and the GPU for its
    compute capability while it traces cuDNN's attention; these stand-ins (private to
    jax 0.10, pinned) answer as cuDNN 9.10 on Hopper would, for a step lowered for CUDA
    with ``jax.export``."""
    import jax
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    class Version:
        @staticmethod
        def cudnn_get_version():
            return 91000

    monkeypatch.setattr(cudnn, "cuda_versions", Version)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


@pytest.fixture(scope="module", autouse=True)
def no_ray_left_behind():
    """A module that leaves a Ray instance up (e.g. a redray.Stream read outside a
    ``local_ray`` fixture starts one) would make every later module's ``ray.init``
    fail: it is shut down at the module's end, after the module's own fixtures."""
    yield
    import sys

    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()


# A session that dies without a word (Ray ending its driver, the OOM killer) is reported
# by a watcher beside it: the test it was running and why Ray says it ended
# (tests/crash_report.py). Not under pytest-xdist (-n): it names a crashed worker's test
# itself.
_CRASH_STATE = None


def pytest_configure(config):
    global _CRASH_STATE
    import contextlib
    import subprocess
    import sys
    import tempfile

    if config.option.collectonly or getattr(config.option, "numprocesses", None):
        return
    _CRASH_STATE = tempfile.mkdtemp(prefix="redray-tests-state-")
    capture = config.pluginmanager.getplugin("capturemanager")  # None under -p no:capture
    # started with the session's real stderr, not the capture's file
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__),
                                                       "crash_report.py"),
                          str(os.getpid()), _CRASH_STATE],
                         stdin=subprocess.DEVNULL, start_new_session=True)


def pytest_runtest_logstart(nodeid, location):
    if _CRASH_STATE:
        from crash_report import CURRENT

        with open(os.path.join(_CRASH_STATE, CURRENT), "w") as f:
            f.write(nodeid + "\n")


def pytest_unconfigure(config):
    if _CRASH_STATE:
        from crash_report import FINISHED

        open(os.path.join(_CRASH_STATE, FINISHED), "w").close()
