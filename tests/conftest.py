"""Test configuration: strict rank promotion, 8 CPU devices for the sharding tests, derandomized hypothesis,
a compilation cache.

``jax_num_cpu_devices`` is set before jax first creates its backends; unlike an
``XLA_FLAGS`` default it cannot be silently overridden by the environment, and
the sharding tests fail (not skip) when the devices are missing.
"""

import os
import pathlib

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

# JAX's persistent compilation cache, shared by the pytest-xdist workers of a run and kept between runs (in
# build/jax-test-cache, ignored by git; OPTAX_SPARSE_ADAM_TEST_CACHE names another directory, or "" for none): many
# tests compile the same programs, and a rerun compiles only what changed. An entry's key is the program's HLO with
# jax's and XLA's versions and options, so a changed library or jax compiles anew; the kernels are looked up by
# name in the built library when an executable loads, so rebuilding them needs no new entry.
_CACHE = os.environ.get(
    "OPTAX_SPARSE_ADAM_TEST_CACHE", str(pathlib.Path(__file__).parent.parent / "build" / "jax-test-cache")
)
if _CACHE:
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

import optax_sparse_adam as osa  # noqa: E402

# The same examples on every run: a property test fails where its code changed, not where a draw was unlucky.
settings.register_profile("deterministic", derandomize=True)
settings.load_profile("deterministic")


@pytest.fixture(params=["native-cpu", "xla"])
def kernel_path(request: pytest.FixtureRequest):
    """Runs a test on the native CPU kernels and again on the XLA path."""
    with osa.use_kernels(request.param == "native-cpu"):
        if osa.kernel_path() != request.param:
            pytest.skip("the native kernels were not built (no C++ compiler at install time)")
        yield request.param


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long items first: the ``slow`` ones (builds, scripts, notebooks, the docs site) and the doctests (each
    compiles a whole example), then the rest in their order. With ``--dist worksteal`` (``make test``) a worker that
    runs out takes the other's last items, and those are short: the two workers finish together."""
    items.sort(key=lambda item: not (item.get_closest_marker("slow") or isinstance(item, pytest.DoctestItem)))


# --compile-times N: how much of each test's time went to JAX's backend compile (XLA compiling an executable, or
# loading it from the persistent cache: OPTAX_SPARSE_ADAM_TEST_CACHE= turns the cache off, as on a fresh machine),
# to find where the suite's time goes. The hooks that time it are registered only where it is asked for. Each worker
# times its own tests; the times reach the report in the tests' user_properties.
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--compile-times",
        type=int,
        default=0,
        metavar="N",
        help="report the share of the tests' time spent in XLA compiles (or cache loads), the N tests that spent the"
        " most, and the N compiled functions that took the most",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("compile_times"):
        config.pluginmanager.register(_CompileTimes(config.getoption("compile_times")), "compile-times")


class _CompileTimes:
    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self, longest: int) -> None:
        self.longest = longest
        # Since the running test's setup began, by compiled function (jit's name for it): [seconds, compiles].
        self.by_name: dict[str, list[float]] = {}
        self.times: dict[str, list[float]] = {}  # by test: [seconds, compile seconds, compiles]
        self.totals_by_name: dict[str, list[float]] = {}  # over all tests: [compile seconds, compiles]
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)

    def _on_duration(self, event: str, duration: float, **kwargs: object) -> None:
        if event == self.EVENT:
            named = self.by_name.setdefault(str(kwargs.get("fun_name", "?")), [0.0, 0])
            named[0] += duration
            named[1] += 1

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        self.by_name = {}

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
        if call.when == "teardown":
            item.user_properties.append(("compiled_by_name", self.by_name))
        return (yield)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        times = self.times.setdefault(report.nodeid, [0.0, 0.0, 0])
        times[0] += report.duration
        for name, value in report.user_properties:
            if name == "compiled_by_name" and report.when == "teardown":
                for fun_name, (seconds, count) in value.items():
                    times[1] += seconds
                    times[2] += count
                    total = self.totals_by_name.setdefault(fun_name, [0.0, 0])
                    total[0] += seconds
                    total[1] += count

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.times:
            return
        total, compiling, compiles = (sum(t[i] for t in self.times.values()) for i in range(3))
        terminalreporter.section(f"XLA compile times ({self.longest} longest)")
        terminalreporter.write_line(
            f"{compiling:.1f} s of the tests' {total:.1f} s went to {int(compiles)} compiles "
            f"({compiling / total:.0%}; with the persistent cache on, a load counts as one)"
        )
        by_compile_time = sorted(self.times.items(), key=lambda kv: -kv[1][1])
        for nodeid, (seconds, compile_s, count) in by_compile_time[: self.longest]:
            terminalreporter.write_line(f"{compile_s:7.2f} s of {seconds:7.2f} s, {count:4d} compiles  {nodeid}")
        # By the name jit gives the compiled function: a test's own steps (`step`, `<lambda>`), the library's
        # jitted helpers, or an eager operation compiled alone (`broadcast_in_dim`, `convert_element_type`, ...).
        terminalreporter.write_line(f"by compiled function ({self.longest} longest):")
        by_name = sorted(self.totals_by_name.items(), key=lambda kv: -kv[1][0])
        for fun_name, (compile_s, count) in by_name[: self.longest]:
            terminalreporter.write_line(f"{compile_s:7.2f} s, {int(count):5d} compiles  {fun_name}")
