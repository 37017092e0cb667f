"""The CPU runtime of an engine (flagserve/engine/cpu_runtime.py): its thread plan and
environment, pure decisions, and one process started with the huge-pages environment."""
import os
import pathlib
import subprocess
import sys

import pytest

from flagserve.engine.cpu_runtime import (
    ThreadPlan,
    huge_pages_env,
    intel_openmp_library,
    owned_cpus,
    parse_cpu_list,
    plan_threads,
    preload_env,
    replica_cpus,
    tcmalloc_library,
)


def test_an_engine_owning_every_core_binds_one_thread_per_core():
    plan = plan_threads([1, 0], owned=2)
    assert plan == ThreadPlan(2, (0, 1))
    assert plan.env() == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
                          "OMP_PLACES": "{0},{1}", "OMP_PROC_BIND": "close",
                          "GOMP_SPINCOUNT": "3000"}
    for users in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "10000"}):  # the user's stays
        assert "GOMP_SPINCOUNT" not in plan.env(users)


def test_unset_reservation_means_every_allowed_core():
    assert plan_threads([0, 1, 2, 3], owned=None) == ThreadPlan(4, (0, 1, 2, 3))


def test_an_engine_owning_part_of_the_cores_is_not_bound():
    # Two replicas of one core each on a 2-core host: binding both to core 0 would stack them.
    plan = plan_threads([0, 1], owned=1)
    assert plan == ThreadPlan(1, ())
    assert plan.env() == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # no team to wait for


def test_a_reservation_beyond_the_allowed_cores_is_capped():
    assert plan_threads([2, 3], owned=8) == ThreadPlan(2, (2, 3))


def test_bind_off_and_explicit_lists():
    assert plan_threads([0, 1], owned=2, bind="off") == ThreadPlan(2, ())
    assert plan_threads([0, 1, 2, 3], owned=1, bind="1-2") == ThreadPlan(2, (1, 2))
    assert plan_threads([0, 1], owned=2, bind="") == plan_threads([0, 1], owned=2)  # as unset


@pytest.mark.parametrize("bind", ["5", "0-3", "0-1000"])
def test_bind_to_cores_the_process_may_not_use_is_refused(bind):
    """A thread per named core, on cores it cannot run on: OpenMP refused its places, and the
    log named cores the engine did not have."""
    with pytest.raises(ValueError, match="FLAGSERVE_CPU_BIND=.* names cores .* its cores: 0,1"):
        plan_threads([0, 1], owned=2, bind=bind)


@pytest.mark.parametrize("text, cpus", [("0", (0,)), ("0-3", (0, 1, 2, 3)), ("0,2, 4-5", (0, 2, 4, 5)),
                                        ("1,1-2", (1, 2))])
def test_parse_cpu_list(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "0,,1", "1-2-3"])
def test_parse_cpu_list_refuses_nonsense(text):
    with pytest.raises(ValueError, match="FLAGSERVE_CPU_BIND must be auto, off or cores"):
        parse_cpu_list(text)


def test_owned_cpus_reads_rays_omp_setting():
    assert owned_cpus({"OMP_NUM_THREADS": "2"}) == 2
    assert owned_cpus({}) is None
    assert owned_cpus({"OMP_NUM_THREADS": "0"}) is None
    assert owned_cpus({"OMP_NUM_THREADS": "x"}) is None


@pytest.mark.parametrize("host, replicas, cpus", [(2, 1, 2), (2, 2, 1), (2, 3, 2 / 3), (2, 4, 0.5),
                                                  (16, 4, 4), (16, 5, 3), (1, 0, 1)])
def test_replica_cpus_shares_the_host(host, replicas, cpus):
    assert replica_cpus(host, replicas) == cpus


def test_preload_puts_found_libraries_first_once():
    libs = ["/x/libtcmalloc_minimal.so.4", "/v/lib/libiomp5.so"]
    assert preload_env({}, libs) == {"LD_PRELOAD": "/x/libtcmalloc_minimal.so.4:/v/lib/libiomp5.so"}
    assert preload_env({"LD_PRELOAD": "/a.so"}, libs[:1]) == {
        "LD_PRELOAD": "/x/libtcmalloc_minimal.so.4:/a.so"}
    assert preload_env({"LD_PRELOAD": ":".join(libs)}, libs) == {}  # already there: nothing to add
    assert preload_env({"FLAGSERVE_CPU_PRELOAD": "0"}, libs) == {}
    assert preload_env({"FLAGSERVE_CPU_PRELOAD": "off"}, libs) == {}  # as every other switch
    with pytest.raises(ValueError, match="FLAGSERVE_CPU_PRELOAD must be one of"):
        preload_env({"FLAGSERVE_CPU_PRELOAD": "false"}, libs)  # not quietly on
    assert preload_env({}, []) == {}  # nothing installed: silently nothing


def test_huge_pages_are_asked_for_unless_the_user_chose():
    assert huge_pages_env({}) == {"THP_MEM_ALLOC_ENABLE": "1"}
    assert huge_pages_env({"THP_MEM_ALLOC_ENABLE": "0"}) == {}  # off, the user's choice


def test_runtime_libraries_are_found_where_they_exist(tmp_path):
    (tmp_path / "sys").mkdir()
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    assert tcmalloc_library([str(tmp_path / "sys")]) == []
    assert intel_openmp_library(str(tmp_path / "venv")) == []
    (tmp_path / "sys" / "libtcmalloc_minimal.so.4").touch()
    (tmp_path / "venv" / "lib" / "libiomp5.so").touch()
    assert tcmalloc_library([str(tmp_path / "sys")]) == [str(tmp_path / "sys" / "libtcmalloc_minimal.so.4")]
    assert intel_openmp_library(str(tmp_path / "venv")) == [str(tmp_path / "venv" / "lib" / "libiomp5.so")]


def test_a_process_started_with_the_huge_pages_env_gets_them():
    setting = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    mode = setting.read_text() if setting.exists() else "[never]"
    if "[madvise]" not in mode:  # `always` gives them unasked, `never` not at all
        pytest.skip(f"transparent huge pages here: {mode.strip()}")
    script = ("import torch\n"
              "x = torch.ones(64 << 18)  # 64 MB, touched\n"
              "for line in open('/proc/self/smaps_rollup'):\n"
              "    if line.startswith('AnonHugePages:'): print(int(line.split()[1]))\n")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    kib = [int(subprocess.run([sys.executable, "-c", script], env={**env, **extra},
                              capture_output=True, text=True, check=True).stdout)
           for extra in ({}, huge_pages_env(env))]
    assert kib[1] >= 32 * 1024 > kib[0], kib
