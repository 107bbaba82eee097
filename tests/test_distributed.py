"""Several ranks (issue #44): results exchanged as flat tensors, a lost rank stopping the others
in one line, ``--resume`` across rank counts (compressor/distributed.py).

The process tests start each rank as its own ``kvq`` process (tests/rank_faults.py, with the
environment torchrun would set, or under torchrun itself) on a 4-layer tiny llama with gloo.
"""

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from compressor import distributed as d
from compressor import flat
from compressor.commands.options import QuantizeOptions
from compressor.commands.quantize import run_quantize
from compressor.entry import RANKS_ENV, ranks_defaults
from compressor.errors import InputError
from compressor.manifest import load_manifest
from compressor.moe_ranks import (AWQ_ROUNDED_COST, AWQ_SEARCHED_COST, Stash, bounds, expert_costs, lend,
                                  solve_costs)
from compressor.safetensors_io import read_header
from compressor.source.lazy import ROUTED_EXPERT
from compressor.staging import Staging, kept_note

from conftest import digests
from rank_procs import DRIVER, ends, free_port, kvq_lines, rank_env, ranks
from tiny_models import ROW_FAST, make_published

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(group_size=32, calib_samples=4, calib_seqlen=32, threads=1)
ARGS = ["--algorithm", "gptq", "--group-size", "32", "--calib-samples", "4", "--calib-seqlen", "32", "--threads", "1",
        "--json"]


def same_bits(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


# ---------------------------------------------------------------------------------------
# flat tensors

def _roundtrip(obj):
    codes, chunks = flat.pack(obj)
    payload = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    return flat.unpack(codes, payload)


def test_pack_round_trips_bit_for_bit():
    """Every dtype a GPTQ result or a checkpoint holds, odd shapes, floats by their bits."""
    w = torch.randn(6, 8)
    tensors = [w.to(dt) for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn)]
    tensors += [torch.randint(-8, 8, (3, 5), dtype=torch.int8), torch.arange(7, dtype=torch.int32),
                torch.tensor(3, dtype=torch.int64), torch.zeros(0, 4), torch.tensor([True, False]), w.t()[2:5]]
    obj = {"t": tensors, 3: (None, True, 0, -2**63, 2**63 - 1, float("nan"), -0.0, 1e-300, float("inf")),
           "s": ["", "äµ layer.0", {"nested": [1.5, None]}]}
    got = _roundtrip(obj)
    assert all(same_bits(a, b) for a, b in zip(got["t"], tensors)) and len(got["t"]) == len(tensors)
    assert all(g.untyped_storage().data_ptr() != w.untyped_storage().data_ptr() for g in got["t"])
    f = got[3]
    assert f[:5] == (None, True, 0, -2**63, 2**63 - 1) and type(f[1]) is bool and type(f[2]) is int
    assert f[5] != f[5] and str(f[6]) == "-0.0" and f[7] == 1e-300 and f[8] == float("inf")
    assert got["s"] == obj["s"]
    assert _roundtrip([]) == [] and _roundtrip(None) is None


@pytest.mark.parametrize("bad", [object(), 2**63, torch.zeros(2, dtype=torch.complex64), {1, 2}])
def test_pack_refuses_what_it_cannot_send(bad):
    with pytest.raises(TypeError, match="cannot send"):
        flat.pack({"x": [bad]})


def test_deal_and_share_without_a_group_are_plain_calls():
    assert d.deal([1, 2, 3], lambda t: t * 10) == [10, 20, 30]
    x = {"a": torch.ones(2)}
    assert d.share(x) is x
    assert d.deal([1, 2, 3], lambda t: t * 10, costs=[5.0, 1.0, 9.0]) == [10, 20, 30]


def test_owners_take_the_largest_task_first_to_the_least_loaded_rank():
    assert d.owners([5, 1, 9, 4], 2) == [1, 0, 0, 1]  # 9 -> 0, 5 -> 1, 4 -> 1 (5 < 9), 1 -> 0 (9 = 9: lower rank)
    assert d.owners([3, 3, 3], 2) == [0, 1, 0]  # ties: the lower index first, the lower rank
    assert d.owners([], 3) == [] and d.owners([7], 3) == [0]


# ---------------------------------------------------------------------------------------
# the watch, on an in-process store

class Ranks:
    """Rank 0's watch over ranks 1 and 2 whose heartbeats the test moves by hand."""

    def __init__(self, timeout=0.6, store=None):
        self.store = store or dist.HashStore()
        self.lines: list[str] = []
        self.stopped = threading.Event()
        self.watch = d.Watch(self.store, 0, 3, timeout, "t", "127.0.0.1:1", stop=self._stop)

    def _stop(self, line):
        self.lines.append(line)
        self.stopped.set()

    def beat(self, *ranks):
        for r in ranks:
            self.store.add(f"t/hb/{r}", 1)

    def state(self, r, state):
        self.store.add(f"t/state/{r}", state)

    def beat_for(self, seconds, *ranks):
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.stopped.is_set():
            self.beat(*ranks)
            time.sleep(0.02)


def test_a_silent_rank_is_named_and_marked_lost():
    r = Ranks()
    r.beat_for(0.5, 1, 2)  # both alive a while
    r.beat_for(3, 1)  # rank 2 goes silent
    assert r.stopped.is_set() and len(r.lines) == 1
    assert r.lines[0].startswith("kvq: rank 2 of 3 stopped responding") and r.lines[0].endswith("rank 0 stops too")
    assert int(r.store.get("t/lost/2")) == 1 and int(r.store.get("t/state/0")) == d.PEER_STOPPED


def test_a_rank_found_lost_by_another_is_named_as_it_did():
    r = Ranks(timeout=30)
    r.store.add("t/lost/1", 1)
    r.beat_for(3, 1, 2)
    assert r.lines and r.lines[0].startswith("kvq: rank 1 of 3 died")


def test_a_rank_stopped_on_its_own_error_is_named_unless_this_one_stops_too():
    r = Ranks(timeout=30)
    r.watch.own_stop = True  # stopping for a reason of its own: the others' stops are not news
    r.state(2, d.ERROR)
    r.beat_for(1, 1)
    assert not r.lines
    r.watch.own_stop = False
    r.beat_for(3, 1)
    assert r.lines == ["kvq: rank 2 of 3 stopped on an error (its own line says which); rank 0 stops too"]


def test_a_finished_rank_may_go_silent():
    r = Ranks()
    r.state(1, d.FINISHED)
    r.beat_for(2, 2)
    assert not r.lines
    r.watch.say(d.FINISHED)
    assert int(r.store.get("t/state/0")) == d.FINISHED


def test_finished_ends_the_watch_and_destroys_the_group(tmp_path, monkeypatch):
    """After the last collective a rank's watch thread has ended and its process group is gone:
    a gloo group left to the interpreter's exit may end a run that succeeded in SIGABRT."""
    r = Ranks()
    monkeypatch.setitem(d._watch, "now", r.watch)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        d.finished()
        assert not dist.is_initialized() and not r.watch._thread.is_alive() and "now" not in d._watch
        assert int(r.store.get("t/state/0")) == d.FINISHED and d.world() == (0, 1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_settle_returns_once_every_rank_is_seen_alive():
    r = Ranks(timeout=30)
    beating = threading.Thread(target=r.beat_for, args=(20, 1, 2), daemon=True)
    beating.start()
    r.watch.settle(own=True)
    r.stopped.set()  # ends the beating thread
    assert not r.lines and r.watch.settled.is_set()  # returned as both were seen alive, not at its time limit


def test_settle_names_a_rank_that_died_meanwhile():
    r = Ranks(timeout=30)
    r.watch.note = lambda: "; 2 of 4 layers are kept"
    beating = threading.Thread(target=r.beat_for, args=(30, 1), daemon=True)
    beating.start()
    r.watch.settle(own=False)  # after a failed collective: rank 2 never beats again
    assert r.stopped.wait(5)
    assert r.lines[0].startswith("kvq: rank 2 of 3 died: no heartbeat for ") and r.lines[0].endswith(
        "rank 0 stops too; 2 of 4 layers are kept")


class _Gone:
    """A store whose server went away after ``ok`` requests."""

    def __init__(self, ok):
        self.inner, self.ok = dist.HashStore(), ok

    def __getattr__(self, name):
        def call(*a):
            self.ok -= 1
            if self.ok < 0:
                raise dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")
            return getattr(self.inner, name)(*a)
        return call


def test_a_store_that_stops_answering_names_rank_0():
    r = Ranks(store=_Gone(12))
    assert r.stopped.wait(5)
    assert r.lines[0].startswith("kvq: rank 0 of 3 is gone (the rendezvous store at 127.0.0.1:1")


def test_peer_timeout_from_the_environment(monkeypatch):
    assert d.peer_timeout() == d.PEER_TIMEOUT_S
    monkeypatch.setenv("KVQ_PEER_TIMEOUT_S", "12.5")
    assert d.peer_timeout() == 12.5
    for bad in ("0", "x", "601"):
        monkeypatch.setenv("KVQ_PEER_TIMEOUT_S", bad)
        with pytest.raises(InputError, match="KVQ_PEER_TIMEOUT_S must be a number of seconds from 1 to 600"):
            d.peer_timeout()


def test_cpp_warnings_are_quieted_under_several_ranks_only():
    assert ranks_defaults({"WORLD_SIZE": "1"}) == {}
    env = {"WORLD_SIZE": "2"}
    assert ranks_defaults(env) == RANKS_ENV and env["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    env = {"WORLD_SIZE": "2", "TORCH_CPP_LOG_LEVEL": "INFO"}
    assert ranks_defaults(env) == {} and env["TORCH_CPP_LOG_LEVEL"] == "INFO"


def test_kept_note(tmp_path):
    st = Staging(tmp_path / ".o.kvq-partial", "k")
    assert kept_note(st, 4) == "; no layer was finished"
    st.state = {"layers_done": 2}
    assert kept_note(st, 4) == (f"; 2 of 4 layers are kept in {st.path}: rerun the same command with --resume "
                                "(with any number of ranks) to continue")


# ---------------------------------------------------------------------------------------
# ranks as processes

#: the single-process references: GPTQ symmetric, and asymmetric with act-order (zero points, g_idx)
VARIANTS = {"sym": {}, "asym": dict(symmetric=False, act_order=True, format="gptq")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, deep_dir):
    """Each of :data:`VARIANTS`' digests from one process."""
    where = tmp_path_factory.mktemp("ref")
    return {name: digests(run_quantize(QuantizeOptions(model=str(deep_dir), output=where / name, algorithm="gptq",
                                                       **kw, **FAST))["output"])
            for name, kw in VARIANTS.items()}


@pytest.mark.slow  # starts processes
def test_tensor_collectives_give_the_single_process_artifact(tmp_path, deep_dir, reference):
    """Two ranks with torch.distributed's object collectives made to raise: the results travel as
    tensors, and the artifact equals the single-process one digest by digest (zero points, g_idx)."""
    out = tmp_path / "asym"
    args = [deep_dir, "-o", out, *ARGS, "--asymmetric", "--act-order", "--format", "gptq"]
    got = ends(ranks(2, args, KVQ_NO_PICKLE="1"))
    assert [g[0] for g in got] == [0, 0], got
    assert digests(out) == reference["asym"]


@pytest.mark.slow
def test_a_killed_rank_stops_the_other_and_the_run_resumes_with_any_rank_count(tmp_path, deep_dir, reference):
    """Rank 1 killed in the middle of layer 2: rank 0 exits 1 with one line naming it and where
    the two finished layers are; the checkpoint resumed by two ranks and, copied, by one gives
    the uninterrupted artifact."""
    out = tmp_path / "a" / "r"
    (rc0, _, err0), (rc1, _, _) = ends(ranks(2, [deep_dir, "-o", out, *ARGS], KVQ_FAULT="1:2:kill"))
    assert rc1 == -signal.SIGKILL and rc0 == 1
    assert len(kvq_lines(err0)) == 1 and re.fullmatch(
        r"kvq: rank 1 of 2 died: no heartbeat for \d+ s; rank 0 stops too; 2 of 4 layers are kept in "
        + re.escape(str(tmp_path / "a" / ".r.kvq-partial")) + r": rerun the same command with --resume \(with any "
        r"number of ranks\) to continue", kvq_lines(err0)[0]), err0
    one = tmp_path / "b" / "r"
    shutil.copytree(tmp_path / "a" / ".r.kvq-partial", tmp_path / "b" / ".r.kvq-partial")
    got = ends(ranks(2, [deep_dir, "-o", out, *ARGS, "--resume"]))
    assert [g[0] for g in got] == [0, 0], got
    assert json.loads(got[0][1])["resumed_from_layer"] == 2 and digests(out) == reference["sym"]
    s = run_quantize(QuantizeOptions(model=str(deep_dir), output=one, algorithm="gptq", resume=True, **FAST))
    assert s["resumed_from_layer"] == 2 and digests(one) == reference["sym"]


@pytest.mark.slow
@pytest.mark.parametrize("fault, line", [
    ("0:1:kill", "kvq: rank 0 of 2 is gone (the rendezvous store at 127.0.0.1:"),
    ("1:1:stop", "kvq: rank 1 of 2 stopped responding (it died, hangs, or its machine is unreachable): no heartbeat"),
    ("0:1:error", "kvq: rank 0 of 2 stopped on an error (its own line says which); rank 1 stops too"),
], ids=["rank-0-killed", "rank-1-hung", "rank-0-error"])
def test_a_lost_rank_is_named_in_one_line(tmp_path, deep_dir, fault, line):
    """Rank 0 (which keeps the store without torchrun) killed; rank 1 hung (SIGSTOP: as an
    unreachable machine, its connections stay open); rank 0 stopped by an error of its own."""
    lost, _, how = fault.split(":")
    procs = ranks(2, [deep_dir, "-o", tmp_path / "o", *ARGS], KVQ_FAULT=fault)
    try:
        rc, _, err = ends([procs[1 - int(lost)]])[0]
    finally:
        if how == "stop":
            procs[int(lost)].kill()
        lost_rc, _, lost_err = ends([procs[int(lost)]])[0]
    assert rc == 1 and len(kvq_lines(err)) == 1 and kvq_lines(err)[0].startswith(line), err
    if how == "error":  # the rank at fault says its own error
        assert lost_rc == 2 and kvq_lines(lost_err) == ["kvq: error: a simulated input error on rank 0"], lost_err


def _torchrun(launch: list, args: list, **env) -> subprocess.Popen:
    torchrun = Path(sys.executable).with_name("torchrun")
    return subprocess.Popen([str(torchrun), *launch, str(DRIVER), "quantize", *map(str, args)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=rank_env(**env))


@pytest.mark.slow
def test_under_torchrun_one_node_and_two(tmp_path, deep_dir):
    """Rank 1 killed mid-layer under torchrun: on one machine (torchrun stops rank 0 with SIGTERM)
    and as two nodes on this one (rank 0 finds out by itself); rank 0's line names rank 1."""
    one = _torchrun(["--nproc-per-node", "2", "--master-port", str(free_port())],
                    [deep_dir, "-o", tmp_path / "one", *ARGS], KVQ_FAULT="1:2:kill")
    rc, _, err = ends([one])[0]
    assert rc != 0 and [ln for ln in err.splitlines() if ln.startswith("kvq:")] == [
        ln for ln in err.splitlines() if ln.startswith("kvq: rank 1 of 2 died: no heartbeat for")] != [], err
    port = str(free_port())
    nodes = [_torchrun(["--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "t44"],
                       [deep_dir, "-o", tmp_path / "two", *ARGS], KVQ_FAULT="1:2:kill")
             for n in (0, 1)]
    (rc0, _, err0), (rc1, _, _) = ends(nodes)
    assert rc0 != 0 and rc1 != 0
    assert [ln for ln in err0.splitlines() if ln.startswith("kvq:")] == [
        ln for ln in err0.splitlines() if ln.startswith("kvq: rank 1 of 2 died")] != [], err0


# ---------------------------------------------------------------------------------------
# routed experts owned per rank (compressor/moe_ranks.py)

def test_expert_blocks_are_contiguous_and_cover_every_expert():
    assert [bounds(4, r, 2) for r in range(2)] == [(0, 2), (2, 4)]
    assert [bounds(5, r, 3) for r in range(3)] == [(0, 1), (1, 3), (3, 5)]
    assert [bounds(2, r, 3) for r in range(3)] == [(0, 0), (0, 1), (1, 2)]  # more ranks than experts: some own none


def test_expert_blocks_weighed_by_their_work():
    """Blocks of about equal work (solved experts against rounded ones); every rank keeps at least one expert."""
    cold = set(range(0, 8)) | set(range(40, 64))  # experts 8-39 solved: 24 in the first equal half, 8 in the second
    costs = solve_costs(64, cold)
    (a0, a1), (b0, b1) = [bounds(64, r, 2, costs) for r in range(2)]
    assert a0 == 0 and a1 == b0 and b1 == 64
    work = [sum(costs[a0:a1]), sum(costs[b0:b1])]
    assert abs(work[0] - work[1]) <= AWQ_SEARCHED_COST and work != [sum(costs[:32]), sum(costs[32:])]
    assert [bounds(3, r, 3, [100, 1, 1]) for r in range(3)] == [(0, 1), (1, 2), (2, 3)]
    assert [bounds(4, r, 2, [1, 1, 1, 1]) for r in range(2)] == [(0, 2), (2, 4)]
    assert [bounds(2, r, 3, [5, 5]) for r in range(3)] == [bounds(2, r, 3) for r in range(3)]  # fewer experts


#: the routed (token, slot) counts of the two MoE layers of a 16 x 128 GPTQ run at Kimi K2's width (64 experts)
KIMI_COUNTS = [
    [1, 0, 0, 674, 0, 1589, 222, 13, 708, 7, 0, 2, 489, 456, 89, 0, 939, 1, 0, 561, 0, 0, 1, 644, 1204, 0, 44, 0, 0,
     0, 0, 553, 0, 1286, 0, 290, 636, 357, 954, 1079, 15, 0, 0, 819, 0, 783, 0, 938, 6, 0, 0, 1, 0, 0, 0, 12, 196,
     494, 140, 75, 6, 100, 0, 0],
    [954, 859, 812, 0, 1, 0, 2, 6, 841, 0, 531, 14, 0, 0, 282, 548, 308, 0, 0, 323, 487, 94, 3, 773, 0, 256, 1189,
     460, 66, 0, 0, 191, 0, 0, 0, 1277, 546, 0, 0, 9, 4, 1, 745, 21, 1319, 9, 38, 0, 0, 49, 0, 567, 2, 1071, 0, 0, 0,
     128, 741, 10, 704, 90, 0, 53]]


def _loads(costs, owner, size):
    return [sum(c for c, o in zip(costs, owner) if o == r) for r in range(size)]


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("counts", KIMI_COUNTS)
def test_lent_experts_even_out_the_contiguous_blocks(counts, size):
    """Blocks cut at or below each share (rank 0 never above its own), then experts lent from the heaviest
    rank to the lightest: the loads end closer than half a solved expert, where the best contiguous blocks
    are a solved expert apart; only the experts of a block other than rank 0's move, and each rank's own
    experts stay in its block."""
    cold = {e for e, t in enumerate(counts) if t < 128}
    costs = expert_costs(counts, cold)
    blocks = [r for r in range(size) for _ in range(*bounds(64, r, size, costs, True))]
    assert len(blocks) == 64 and blocks == sorted(blocks)
    assert _loads(costs, blocks, size)[0] <= sum(costs) / size
    closest = [r for r in range(size) for _ in range(*bounds(64, r, size, costs))]
    solver = lend(costs, blocks, size)
    assert solver == lend(costs, blocks, size)  # the same on every rank
    moved = [e for e in range(64) if solver[e] != blocks[e]]
    assert moved and all(blocks[e] != 0 for e in moved)
    after, before = _loads(costs, solver, size), _loads(costs, closest, size)
    assert max(after) - min(after) < min(costs[e] for e in range(64) if e not in cold) / 2  # finer than one solve
    assert max(after) < max(before) - 1.0, (after, before)
    assert lend(costs, [0] * 64, 1) == [0] * 64 and lend([1.0] * 4, [0, 0, 1, 1], 2) == [0, 0, 1, 1]


def test_expert_costs_count_tokens_and_rounding():
    """A solved expert costs its solve and its tokens' forward, a rounded one its rounding; both their reads."""
    from compressor.moe_ranks import READ_SECONDS, ROUNDED_SECONDS, SOLVED_SECONDS, SOLVED_TOKEN_SECONDS, TOKEN_SECONDS

    c = expert_costs([0, 100, 1000], {0, 1})
    assert c[0] == pytest.approx(READ_SECONDS + ROUNDED_SECONDS)
    assert c[1] == pytest.approx(READ_SECONDS + ROUNDED_SECONDS + 100 * TOKEN_SECONDS)
    assert c[2] == pytest.approx(READ_SECONDS + SOLVED_SECONDS + 1000 * (TOKEN_SECONDS + SOLVED_TOKEN_SECONDS))


def test_a_stash_added_after_the_ranks_before_gives_the_single_process_sum():
    """Rank 1's kept rows added into rank 0's sum equal, bit for bit, the accumulator one process fills
    expert after expert; adding the two ranks' partial sums does not (float addition is not associative)."""
    g = torch.Generator().manual_seed(0)
    n, k, tokens, hidden, lo = 8, 4, 64, 16, 3
    idx = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(tokens)])
    ys = {e: torch.randn(int((idx == e).sum()), hidden, generator=g) * 10.0 ** (e % 4) for e in range(n)}
    one, first, later = torch.zeros(tokens, hidden), torch.zeros(tokens, hidden), torch.zeros(tokens, hidden)
    stash = Stash(torch.zeros(int((idx >= lo).sum()), hidden))
    for e in range(n):
        rows = torch.where(idx == e)[0]
        one.index_add_(0, rows, ys[e])
        (first if e < lo else later).index_add_(0, rows, ys[e])
        if e >= lo:
            stash.index_add_(0, rows, ys[e])
    assert not torch.equal(first + later, one)
    stash.fold_into(first)
    assert same_bits(first, one)


def test_rows_of_a_lent_expert_inserted_later_fold_in_expert_order():
    """Rank 1's block is experts 3-7, expert 4 and 6 lent to rank 0: their rows arrive after rank 1's own
    (:meth:`Stash.insert`) and still add in ascending expert order, the one-process sum bit for bit;
    added in arrival order they would not be."""
    g = torch.Generator().manual_seed(1)
    n, k, tokens, hidden, lo, lent = 8, 4, 64, 16, 3, (4, 6)
    idx = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(tokens)])
    ys = {e: torch.randn(int((idx == e).sum()), hidden, generator=g) * 10.0 ** (e % 4) for e in range(n)}
    one, first = torch.zeros(tokens, hidden), torch.zeros(tokens, hidden)
    stash, arrival = Stash(torch.zeros(int((idx >= lo).sum()), hidden)), torch.zeros(tokens, hidden)
    borrowed = Stash(torch.zeros(int(torch.isin(idx, torch.tensor(lent)).sum()), hidden))
    for e in range(n):
        rows = torch.where(idx == e)[0]
        one.index_add_(0, rows, ys[e])
        if e < lo:
            first.index_add_(0, rows, ys[e])
        target = borrowed if e in lent else stash if e >= lo else None
        if target is not None:
            target.expert = e
            target.index_add_(0, rows, ys[e])
    arrival.copy_(first)
    for e in range(lo, n):
        if e not in lent:
            arrival.index_add_(0, torch.where(idx == e)[0], ys[e])
    for e, index, rows in borrowed.kept():
        stash.insert(e, index, rows.clone())
        arrival.index_add_(0, index, rows)
    assert not torch.equal(arrival, one)
    stash.fold_into(first)
    assert same_bits(first, one)


def _solved_by(n: int, rank: int, size: int, costs, lending: bool) -> set[int]:
    """The experts ``rank`` reads and solves: its block, with GPTQ's lending (:func:`lend`) applied."""
    blocks = [r for r in range(size) for _ in range(*bounds(n, r, size, costs, lending))]
    return {e for e, r in enumerate(lend(costs, blocks, size) if lending else blocks) if r == rank}


#: one routed expert held (float32 + int8 codes at hidden 64, expert width 32): a budget of 1.5 reads them one by one
ONE_EXPERT_GIB = 1.5 * 3 * 64 * 32 * 5 / 2**30
MOE_ARGS = ["--group-size", "32", "--calib-samples", "4", "--calib-seqlen", "48", "--threads", "1", "--json"]
#: name: (kvq flags, the single-process run's options)
AWQ_GRID = 4
MOE_CASES = {
    "gptq": (["--algorithm", "gptq"], dict(algorithm="gptq")),
    "gptaq": (["--algorithm", "gptq", "--set", "gptq.gptaq_alpha=0.25"],
              dict(algorithm="gptq", settings=(("gptq.gptaq_alpha", 0.25),))),
    "rtn": (["--algorithm", "rtn"], dict(algorithm="rtn")),  # no calibration pass: the expert groups alone
    "rtn+fp8-static": (["--algorithm", "rtn", "--kv-scheme", "fp8"], dict(algorithm="rtn", kv_scheme="fp8")),
    # activations, the routed sums and a later rank's kept rows memory-mapped (the sums broadcast into the maps)
    "gptq-spilled": (["--algorithm", "gptq", "--activation-budget-gib", "0"],
                     dict(algorithm="gptq", activation_budget_gib=0)),
    # the block's scale searched over every rank's experts: three reads, each rank reading its own (moe_stream_awq);
    # a grid of AWQ_GRID ratios (each one more read of the experts for the single process's budget of one expert)
    "awq": (["--algorithm", "awq", "--set", f"awq.n_grid={AWQ_GRID}"],
            dict(algorithm="awq", settings=(("awq.n_grid", AWQ_GRID),))),
    "awq-gptq": (["--algorithm", "awq-gptq", "--set", f"awq.n_grid={AWQ_GRID}"],
                 dict(algorithm="awq-gptq", settings=(("awq.n_grid", AWQ_GRID),))),
    # cold experts (RTN, no scaling group of their own) beside static fp8 KV scales
    "awq-cold-fp8": (["--algorithm", "awq", "--kv-scheme", "fp8", "--set", "moe.min_tokens=80",
                      "--set", f"awq.n_grid={AWQ_GRID}"],
                     dict(algorithm="awq", kv_scheme="fp8",
                          settings=(("moe.min_tokens", 80), ("awq.n_grid", AWQ_GRID)))),
}
#: the cases run on the DeepSeek-V3 row alone
DEEPSEEK_ONLY = {"gptq-spilled", "awq-cold-fp8"}


@pytest.fixture(scope="module")
def moe_rows(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("moe-ranks")
    return {mt: make_published(root / mt, tokenizer, mt, num_hidden_layers=3) for mt in ("deepseek_v3", "glm4_moe")}


def _expert_bytes(src: Path, layers, experts) -> int:
    """Stored bytes of the routed experts ``experts`` of decoder ``layers`` in ``src``."""
    total = 0
    for shard in src.glob("*.safetensors"):
        for name, e in read_header(shard).items():
            m = ROUTED_EXPERT.search(name)
            if m and int(m.group(1)) in experts and any(name.startswith(f"model.layers.{i}.") for i in layers):
                total += e.end - e.start
    return total


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("model_type,case", [(mt, c) for mt in ("deepseek_v3", "glm4_moe") for c in MOE_CASES
                                             if mt == "deepseek_v3" or c not in DEEPSEEK_ONLY])
def test_ranks_own_the_experts_and_write_the_single_process_artifact(model_type, case, moe_rows, tmp_path):
    """Two ranks on a tiny MoE row (layer 0 dense, layers 1-2 of 4 routed experts), the layers fitting
    the memory budget: each rank reads from the source only its two experts of each MoE layer (and
    the routed experts' bytes read are its half, once per read: AWQ reads them three times), results
    travel as tensors, and the artifact equals the single-process one -- read in groups of one
    expert -- digest by digest, and so do the figures (AWQ's ratios and output error included)."""
    src = moe_rows[model_type]
    flags, kw = MOE_CASES[case]
    run_quantize(QuantizeOptions(model=str(src), output=tmp_path / "one", memory_budget_gib=ONE_EXPERT_GIB,
                                 threads=1, **ROW_FAST, **kw))
    reads = tmp_path / "reads"
    reads.mkdir()
    got = ends(ranks(2, [src, "-o", tmp_path / "two", *flags, *MOE_ARGS], KVQ_NO_PICKLE="1", KVQ_READS=str(reads)))
    assert [g[0] for g in got] == [0, 0], got
    assert digests(tmp_path / "two") == digests(tmp_path / "one")
    # weight_groups: the groups of every rank; awq_expert_reads: the grid's reads, as many candidates at once as
    # the budget holds (one process, one expert's budget: 1 + AWQ_GRID + 1; the ranks, the default: 1 + 1 + 1)
    timing = {"seconds", "phase_seconds", "weight_groups", "awq_expert_reads"}
    full = [load_manifest(o).quality["layers"] for o in (tmp_path / "one", tmp_path / "two")]
    layers = [[{k: v for k, v in f.items() if k not in timing} for f in m] for m in full]
    assert layers[0] == layers[1]
    n_reads = {f["layer"]: f.get("awq_expert_reads", 1) for f in full[1]}  # reads of each layer's experts
    assert [n_reads[i] for i in (1, 2)] == ([3, 3] if "awq" in case else [1, 1])
    assert [f.get("awq_expert_reads") for f in full[0]][1:] == ([AWQ_GRID + 2] * 2 if "awq" in case else [None, None])
    assert load_manifest(tmp_path / "two").quality["moe"] == load_manifest(tmp_path / "one").quality["moe"]
    per_rank = json.loads(got[0][1])["ranks"]
    assert [r["rank"] for r in per_rank] == [0, 1]
    # the experts each rank owns: halves (RTN, float), or blocks of equal work where the routing is known before
    # the first read: GPTQ's solves, AWQ's searches (its cold experts are the float routing's: the manifest's for
    # AWQ; awq-gptq's manifest counts GPTQ's routing, so there the blocks are only checked to divide the experts)
    cold = {m["layer"]: set(m["below_min_tokens"]) for m in load_manifest(tmp_path / "one").quality["moe"]["layers"]}
    weighed = case.startswith(("gptq", "gptaq"))
    counts = {m["layer"]: m["expert_tokens"] for m in load_manifest(tmp_path / "one").quality["moe"]["layers"]}
    costs = {i: expert_costs(counts[i], cold[i]) if weighed else solve_costs(4, cold[i])
             if case.startswith("awq") else None for i in (1, 2)}
    owned = {(i, r): {int(m.group(1)) for n in (reads / f"rank{r}.txt").read_text().split()
                      if n.startswith(f"model.layers.{i}.") and (m := ROUTED_EXPERT.search(n))}
             for i in (1, 2) for r in (0, 1)}
    share = {(i, r): _solved_by(4, r, 2, costs[i], weighed) for i in (1, 2) for r in (0, 1)}
    for i in (1, 2):
        if case == "awq-gptq":
            lo = min(owned[i, 1])
            share[i, 0], share[i, 1] = set(range(lo)), set(range(lo, 4))
        for r in (0, 1):
            assert owned[i, r] == share[i, r], (r, i, owned)
    for r in (0, 1):
        assert per_rank[r]["routed_expert_bytes_read"] == sum(
            n_reads[i] * _expert_bytes(src, (i,), share[i, r]) for i in (1, 2)) > 0
    if weighed:  # the routing leaves the blocks unequal in work: rank 0 solves an expert lent from rank 1's block
        assert any(share[i, 0] & set(range(*bounds(4, 1, 2, costs[i], True))) for i in (1, 2)), (cold, share)


@pytest.mark.slow
@pytest.mark.parametrize("model_type,algorithm", [("deepseek_v3", "gptq"), ("deepseek_v3", "awq"),
                                                  ("glm4_moe", "awq-gptq")])
def test_three_ranks_with_unequal_shares(model_type, algorithm, moe_rows, tmp_path):
    """Four experts on three ranks (blocks of equal work; read one at a time): rank 0 writes every rank's
    groups whatever their number (AWQ: in each of its reads, the grid's candidates one per read); the
    artifact is the single-process one, holding each layer whole."""
    src = moe_rows[model_type]
    run_quantize(QuantizeOptions(model=str(src), output=tmp_path / "one", algorithm=algorithm, threads=1, **ROW_FAST))
    got = ends(ranks(3, [src, "-o", tmp_path / "three", "--algorithm", algorithm, "--memory-budget-gib",
                         str(ONE_EXPERT_GIB), *MOE_ARGS]))
    assert [g[0] for g in got] == [0, 0, 0], got
    assert digests(tmp_path / "three") == digests(tmp_path / "one")
    n_reads = {f["layer"]: f.get("awq_expert_reads", 1) for f in load_manifest(tmp_path / "three").quality["layers"]}
    assert [n_reads[i] for i in (1, 2)] == ([22, 22] if algorithm.startswith("awq") else [1, 1])
    per_rank = json.loads(got[0][1])["ranks"]
    cold = {m["layer"]: set(m["below_min_tokens"]) for m in load_manifest(tmp_path / "one").quality["moe"]["layers"]}
    weighed = algorithm.startswith(("gptq", "gptaq"))
    counts = {m["layer"]: m["expert_tokens"] for m in load_manifest(tmp_path / "one").quality["moe"]["layers"]}
    costs = {i: expert_costs(counts[i], cold[i]) if weighed else solve_costs(4, cold[i]) for i in (1, 2)}
    assert [r["routed_expert_bytes_read"] for r in per_rank] == [
        sum(n_reads[i] * _expert_bytes(src, (i,), _solved_by(4, r, 3, costs[i], weighed)) for i in (1, 2))
        for r in range(3)]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["gptq", "awq-gptq"])  # the fault fires at a GPTQ solve
def test_a_moe_run_killed_mid_layer_resumes_with_two_ranks_or_one(algorithm, moe_rows, tmp_path):
    """Rank 1 killed in the second MoE layer of a run whose ranks own the experts: the two finished
    layers are kept, and resuming them with two ranks or with one gives the single-process artifact."""
    src = moe_rows["deepseek_v3"]
    ref = run_quantize(QuantizeOptions(model=str(src), output=tmp_path / "ref", algorithm=algorithm, threads=1,
                                       **ROW_FAST))
    args = [src, "-o", tmp_path / "a" / "r", "--algorithm", algorithm, *MOE_ARGS]
    (rc0, _, err0), (rc1, _, _) = ends(ranks(2, args, KVQ_FAULT="1:2:kill"))
    assert rc1 == -signal.SIGKILL and rc0 == 1 and "2 of 3 layers are kept in" in err0, err0
    shutil.copytree(tmp_path / "a" / ".r.kvq-partial", tmp_path / "b" / ".r.kvq-partial")
    got = ends(ranks(2, [*args, "--resume"]))
    assert [g[0] for g in got] == [0, 0], got
    assert json.loads(got[0][1])["resumed_from_layer"] == 2 and digests(tmp_path / "a" / "r") == digests(ref["output"])
    one = run_quantize(QuantizeOptions(model=str(src), output=tmp_path / "b" / "r", algorithm=algorithm,
                                       resume=True, threads=1, **ROW_FAST))
    assert one["resumed_from_layer"] == 2 and digests(tmp_path / "b" / "r") == digests(ref["output"])
