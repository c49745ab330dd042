"""`launch/prefill.py` facing bad input and faults: one clear line, the right exit status, no hang, nothing lost.

Ranks are started by torchrun, or by hand (``RANK`` / ``WORLD_SIZE`` in the environment) where a
test needs different options per rank or a rank that starts late. See docs/reliability.md.
"""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from support import zygote
from support.launcher import GENERATE, ROOT, SCRIPT, TINY, all_text, by_hand, run_launcher
from support.ports import free_port

FIRST_ROUND = "round 1/"  # the prefill's progress as its first round starts, in a log (stderr is no terminal)

pytestmark = pytest.mark.spawns_ranks
SMALL = TINY + ["--batch", "2", "--seq-len", "16"]


_OPTIONS = [  # (option, (rank 0's value, rank 1's value), the line that names it)
    ("--seed", ("0", "1"), "ranks disagree on --seed: rank 0: 0; rank 1: 1"),
    ("--layers", ("3", "2"), "ranks disagree on --layers"),
    ("--hidden", ("64", "32"), "ranks disagree on --hidden"),
    ("--mode", ("all", "all,three-batch"), "ranks disagree on --mode: rank 0: ['serial', 'shared', 'two-batch']; "
                                           "rank 1: ['serial', 'shared', 'two-batch', 'three-batch']"),
    ("--experts", ("8", "16"), "ranks disagree on --experts"),
    ("--dtype", ("float32", "bfloat16"), "ranks disagree on --dtype"),
    ("--iters", ("1", "2"), "ranks disagree on --iters"),
]
_ENVIRONMENT = [  # (variable, (rank 0's value, rank 1's value), the line that names it)
    ("OVERLAP_ENABLE", ("1", "0"), "ranks disagree on $OVERLAP_ENABLE: rank 0: 'on'; rank 1: 'off'"),
    ("OVERLAP_CPU_LINK", ("0.1", "2"),
     "ranks disagree on --cpu-link (or its default $OVERLAP_CPU_LINK): rank 0: '0.1 GB/s'; rank 1: '2 GB/s'"),
    ("OVERLAP_CPU_KEEP_MEMORY", ("1", "0"), "ranks disagree on $OVERLAP_CPU_KEEP_MEMORY: rank 0: 'on'; rank 1: 'off'"),
]


@pytest.fixture(scope="module")
def disagreeing_ranks():
    """One job of two ranks started by hand with every option of `_OPTIONS` and every variable of `_ENVIRONMENT`
    different: the ranks post them all before the first collective, and each difference is a line of the one
    error (a job per difference started the same two processes for each line)."""
    return by_hand([SMALL + [arg for option, values, _ in _OPTIONS for arg in (option, values[rank])]
                    for rank in (0, 1)],
                   env=[{name: values[rank] for name, values, _ in _ENVIRONMENT} for rank in (0, 1)])


@pytest.mark.parametrize("option, values, words", _OPTIONS)
def test_ranks_started_with_different_options_stop_with_one_clear_error(disagreeing_ranks, option, values, words):
    outs = disagreeing_ranks
    assert [rc for rc, _, _ in outs] == [2, 2], all_text(outs)[-3000:]
    assert all_text(outs).count(words) == 1, all_text(outs)[-3000:]
    assert FIRST_ROUND not in all_text(outs)  # stopped before the first prefill


@pytest.mark.parametrize("name, values, words", _ENVIRONMENT)
def test_ranks_started_with_a_different_environment_stop_with_one_line_naming_the_variable(disagreeing_ranks, name,
                                                                                          values, words):
    """Before: each rank ran with its own value (one of them single-stream, or on another link), exit 0."""
    outs = disagreeing_ranks
    assert [rc for rc, _, _ in outs] == [2, 2], all_text(outs)[-3000:]
    assert all_text(outs).count(words) == 1, all_text(outs)[-3000:]
    assert FIRST_ROUND not in all_text(outs)


@pytest.fixture(scope="module")
def agreeing_ranks(tmp_path_factory):
    """One job of two ranks started by hand, each with the mode list spelled its own way and requests of its own
    (rank 0 writes --out): (each rank's results, the folder)."""
    out = tmp_path_factory.mktemp("out")
    return by_hand([SMALL + ["--mode", "all,two-batch", "--seq-lens", "3", "--out", str(out)],
                    SMALL + ["--mode", "serial,shared", "--mode", "two-batch", "--seq-lens", "40,21"]]), out


def test_ranks_agree_on_the_mode_list_they_run_however_it_is_spelled(agreeing_ranks):
    outs, _ = agreeing_ranks
    assert [rc for rc, _, _ in outs] == [0, 0], all_text(outs)[-3000:]
    assert "disagree" not in all_text(outs)


def test_tokens_per_second_counts_every_rank(agreeing_ranks):
    outs, out = agreeing_ranks
    assert [rc for rc, _, _ in outs] == [0, 0], all_text(outs)[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["tokens"] == 64
    row = res["rows"][0]
    assert row["tokens_per_s"] == pytest.approx(64 / sorted(row["times_s"])[len(row["times_s"]) // 2])


def test_a_configuration_error_reaches_the_user_when_rank_0_starts_late():
    outs = _by_hand_late_rank0(SMALL + ["--experts", "7"])  # rank 1 has exited before rank 0 starts
    assert [rc for rc, _, _ in outs] == [2, 2]
    assert all_text(outs).count("--experts 7 cannot be split evenly over 2 ranks") == 1


def _by_hand_late_rank0(args):
    port, procs = free_port(), {}
    for rank in (1, 0):
        env = dict(os.environ, PYTHONPATH=ROOT, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
                   RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
        procs[rank] = zygote.Popen([sys.executable, SCRIPT] + args, env=env, cwd=ROOT)
        if rank == 1:
            procs[1].wait(timeout=60)  # rank 1 has finished (and spoken) before rank 0 starts
    return [(procs[r].wait(timeout=60),) + procs[r].communicate() for r in (0, 1)]


def test_non_finite_weights_fail_the_run_with_or_without_check():
    proc = run_launcher(SMALL + ["--check"], ranks=2, env={"OVERLAP_FAULT": "rank=1,kind=nan"})
    assert proc.returncode == 1 and "holds NaN or inf" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "every mode matches serial" not in proc.stdout
    proc = run_launcher(SMALL + ["--mode", "serial"], ranks=2, env={"OVERLAP_FAULT": "rank=0,kind=inf"})
    assert proc.returncode == 1 and "FAILED: serial's output holds NaN or inf" in proc.stdout, proc.stdout[-2000:]


def test_a_run_too_big_for_the_memory_is_refused_with_the_numbers():
    proc = run_launcher(TINY + ["--preset", "deepseek-v3", "--experts", "8", "--batch", "1", "--seq-len", "8"], ranks=2)
    out = proc.stdout + proc.stderr
    # a line per rank at most: ranks whose free memory reads alike (to 0.01 GiB) share one
    assert proc.returncode != 0 and 1 <= out.count("needs about") <= 2 and "GiB of host memory" in out, out[-3000:]
    assert FIRST_ROUND not in out


def test_an_unwritable_out_is_refused_before_the_run(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    proc = run_launcher(SMALL + ["--out", str(blocked / "out")], ranks=2)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and out.count("is not writable") == 1 and FIRST_ROUND not in out, out[-3000:]


def _kv_folder_is_a_file(out):
    (out / "kv").write_text("not a folder")


def _kv_file_is_a_folder(out):
    (out / "kv" / "kv-rank0.kv").mkdir(parents=True)


def _kv_folder_read_only(out):
    (out / "kv").mkdir(parents=True)
    (out / "kv").chmod(0o500)


# root writes anywhere: a root run gives up overriding file permissions (kept out of its capability bounding set)
_AS_OWNER = (["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
             if os.geteuid() == 0 and shutil.which("setpriv") else [])


@pytest.mark.parametrize("spoil, words", [
    (_kv_folder_is_a_file, "the KV store folder {out}/kv is not a folder"),
    (_kv_file_is_a_folder, "the KV store file {out}/kv/kv-rank0.kv is not a regular file"),
    pytest.param(_kv_folder_read_only, "the KV store folder {out}/kv is not writable",
                 marks=pytest.mark.skipif(os.geteuid() == 0 and not _AS_OWNER, reason="root writes anywhere")),
])
def test_a_kv_store_folder_that_cannot_hold_the_files_is_refused_before_the_run(tmp_path, spoil, words):
    """``--kv-offload --kv-store mmap --out D`` keeps each rank's store in D/kv (before: a traceback, exit 1)."""
    out = tmp_path / "out"
    out.mkdir()
    spoil(out)
    try:
        proc = subprocess.run(_AS_OWNER + [sys.executable, SCRIPT] + SMALL + [
            "--kv-offload", "--kv-store", "mmap", "--out", str(out), "--mode", "serial"], capture_output=True,
            text=True, timeout=180, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    finally:
        if (out / "kv").is_dir():
            (out / "kv").chmod(0o700)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert text.count(words.format(out=out)) == 1 and "Traceback" not in text, text[-3000:]
    assert FIRST_ROUND not in text


def test_an_out_replaced_by_a_file_during_the_run_is_one_line_naming_it(tmp_path):
    """(Before: os.makedirs' FileExistsError, a traceback after the run.)"""
    from launch.outputs import OutputError, write_generation_outputs

    out = tmp_path / "out"
    out.write_text("not a folder")
    with pytest.raises(OutputError, match=f"cannot write to --out {out}: File exists \\(not a folder\\)"):
        write_generation_outputs(str(out), None, None, [], 2, [], print)


def test_outputs_are_written_whole_or_not_at_all(tmp_path):
    from launch.outputs import OutputError, _atomic

    target = tmp_path / "results.json"
    target.write_text("old")

    def full_disk(name):
        with open(name, "w") as f:
            f.write("partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OutputError, match=r"cannot write .*results.json: No space left on device"):
        _atomic(str(target), full_disk)
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_a_rank_that_never_starts_is_named():
    proc = run_launcher(SMALL + ["--timeout", "5"], ranks=2, env={"OVERLAP_FAULT": "rank=1,iter=-1,kind=hang"},
                        timeout=120)
    assert proc.returncode != 0
    assert "not every rank joined the job within --timeout 5 s: rank 1 never started" in proc.stderr, \
        proc.stderr[-3000:]


def test_usage_errors_are_printed_once_under_torchrun():
    proc = run_launcher(SMALL + ["--mode", "bogus"], ranks=2)
    assert proc.returncode != 0
    assert (proc.stdout + proc.stderr).count("Invalid value for '--mode'") == 1


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupted_runs_leave_no_kv_files(tmp_path, sig, status):
    env = dict(os.environ, PYTHONPATH=ROOT, TMPDIR=str(tmp_path), OVERLAP_FAULT="rank=0,iter=0,kind=hang")
    proc = zygote.Popen([sys.executable, SCRIPT] + SMALL + ["--kv-offload", "--kv-store", "mmap"], env=env, cwd=ROOT)
    seen = ""
    deadline = time.monotonic() + 120
    while FIRST_ROUND not in seen and time.monotonic() < deadline:
        seen += proc.stderr.readline()
    if FIRST_ROUND not in seen:
        proc.kill()
        pytest.fail(f"the launcher did not reach its run within 120 s: {seen[-3000:]}")
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"the launcher did not end within 60 s of {sig.name}: {seen[-2000:]}{err[-3000:]}")
    assert proc.returncode == status, seen + err
    assert not list(tmp_path.glob("kv-*")), list(tmp_path.iterdir())


def test_a_link_too_slow_for_the_timeout_is_one_line_not_a_hang():
    proc = run_launcher(SMALL + ["--cpu-link", "1e-9", "--timeout", "10", "--mode", "serial"], ranks=2, timeout=90)
    assert proc.returncode != 0
    assert "needs" in proc.stderr and "more than the 10 s wait bound" in proc.stderr, proc.stderr[-3000:]
    assert "unexpected error" not in proc.stderr


def test_a_rank_that_exits_during_decode_is_named_by_the_other():
    """$OVERLAP_FAULT's iter counts decode steps in `launch/generate.py` (before: only nan / inf had an effect)."""
    proc = run_launcher(TINY + ["--batch", "2", "--seq-len", "8", "--new-tokens", "4", "--mode", "serial",
                                "--timeout", "10"], ranks=2, env={"OVERLAP_FAULT": "rank=1,iter=1,kind=exit"},
                        script=GENERATE, timeout=120)
    assert proc.returncode != 0
    assert "rank 0: rank 1 has exited" in proc.stderr, proc.stderr[-3000:]
    assert "unexpected error" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.timeout(120)
def test_a_rank_stopped_during_decode_is_named_by_every_other_rank():
    """SIGSTOP of rank 1 of 3 mid-decode: ranks 0 and 2 name it (before: the oldest round-start beat was named)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port", str(free_port()),
           GENERATE] + TINY + ["--experts", "6", "--batch", "2", "--seq-len", "8", "--new-tokens", "3000",
                               "--mode", "serial", "--timeout", "4"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("OVERLAP_FAULT", None)
    agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    seen = ""
    while "step 0" not in seen and agent.poll() is None:
        seen += agent.stderr.readline()
    rank1 = next((pid for pid in _children(agent.pid) if _environ(pid).get("RANK") == "1"), None)
    if rank1 is None:
        agent.kill()
        pytest.fail(f"no rank 1 decoding: {(seen + agent.communicate()[1])[-3000:]}")
    os.kill(rank1, signal.SIGSTOP)
    named = [f"rank {r}: rank 1 is stopped (SIGSTOP" for r in (0, 2)]
    err = ""
    try:
        while not all(line in err for line in named) and agent.poll() is None:
            err += agent.stderr.readline()
    finally:
        try:
            os.kill(rank1, signal.SIGKILL)  # torchrun would wait 30 s for a stopped rank to take its SIGTERM
        except ProcessLookupError:
            pass
        err += agent.communicate(timeout=60)[1]
    for line in named:
        assert line in err, (seen + err)[-3000:]


def _children(pid):
    """The processes whose parent is ``pid`` (read from each process's stat: not every kernel lists children)."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(name))
        except (OSError, IndexError, ValueError):
            pass
    return found


def _environ(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.decode().partition("=")[::2] for item in f.read().split(b"\0") if item)
