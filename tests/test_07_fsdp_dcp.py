"""Lesson 07 and its lab: FSDP2 trains like DDP and one process, and its distributed checkpoint
loads on another number of ranks exactly as saved.

Command-line runs are what a user sees (the lab's proof, a break, a crashed rank, the lesson copied
alone); the checkpoint that the lesson alone saved on 2 ranks is then loaded and damaged in-process,
in a world of one rank."""
import filecmp
import json
import os
import re
import shutil
import sys
import uuid

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from conftest import (assert_help_in_process, assert_refused_in_process,
                      REPO, assert_crashed_rank_stops_the_run, kill_leftovers, last_line_matching,
                      load_script, number_after, run_lesson, run_once_per_session,
                      run_readme_command)

LAB = "07_fsdp_dcp/prove.py"
LESSON = "07_fsdp_dcp/fsdp_dcp.py"
TOLERANCE = 1e-5
MiB = 2 ** 20
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def prove():
    return load_script(LAB)


def proof(stdout):
    """(passed, against DDP, against one process, after loading, resumed) from the PROOF line."""
    line = last_line_matching(r"^PROOF (PASSED|FAILED): ", stdout)
    return (line.startswith("PROOF PASSED"), number_after("against DDP", line),
            number_after("against one process", line), number_after("after loading", line),
            number_after("resumed", line))


# --- the lab, run as the README runs it ---------------------------------------------------------

def test_fsdp2_equals_ddp_and_its_checkpoint_loads_on_1_and_3_ranks():
    result = run_readme_command(f"python {LAB}")  # the same run the README output test reads
    assert result.returncode == 0, result.stderr[-3000:]
    passed, vs_ddp, vs_single, after_loading, resumed = proof(result.stdout)
    assert passed and vs_ddp <= TOLERANCE and vs_single <= TOLERANCE and resumed <= TOLERANCE
    assert after_loading == 0.0, "a checkpoint must give back every value exactly"
    for m in (1, 3):  # each world size's own line: loaded exactly, then trained like one process
        line = last_line_matching(rf"^loaded on {m} rank\(s\): ", result.stdout)
        assert number_after("against the saved ones: max |d|", line) == 0.0
        assert number_after("on the same batches: max |dw|", line) <= TOLERANCE
    files = last_line_matching(r"^fsdp/epoch0001 holds ", result.stdout)
    assert ".metadata" in files and "__0_0.distcp" in files and "__1_0.distcp" in files
    assert "__2_0.distcp" not in files, "two ranks saved it: one file each, and the metadata"


def test_a_skipped_step_fails_the_proof():
    result = run_readme_command(f"python {LAB} --break skip-step")  # shared with the README's block
    assert result.returncode == 1, result.stderr[-3000:]
    passed, vs_ddp, vs_single, after_loading, resumed = proof(result.stdout)
    assert not passed and vs_ddp > 1e-3 and vs_single > 1e-3
    assert after_loading == 0.0, "the checkpoint still holds what was trained, missed step and all"
    assert result.stdout.splitlines()[-1] == (
        "LIKELY CAUSE: a rank skipped an optimizer step: rank(s) 1 ran 15 optimizer steps, the "
        "others 16, so their shards missed an update (against DDP, first in 0.weight); every rank "
        "must run every optimizer.step() (fsdp_dcp.py line 47)")


def test_a_crashed_rank_stops_the_run(lesson):
    assert_crashed_rank_stops_the_run(lesson, LAB)


# --- the lesson alone, then its checkpoint in-process (a world of one rank) ------------------------

@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """The lesson copied alone into an empty folder, run as a user runs it: 2 ranks, 2 epochs.
    Its checkpoints (saved by 2 ranks) are what the in-process tests below load and damage."""
    run_once_per_session("test_07_fsdp_dcp.alone")
    folder = tmp_path_factory.mktemp("alone")
    shutil.copy(REPO / LESSON, folder / "fsdp_dcp.py")
    marker = uuid.uuid4().hex
    result = run_lesson(folder / "fsdp_dcp.py", "--world-size", 2, "--epochs", 2, cwd=folder,
                        timeout=90, marker=marker)
    assert not kill_leftovers(marker), "the lesson left processes running"
    return result, folder / "ckpt_fsdp"


def saved_state(path, tmp_path):
    """What a DCP folder holds, whole (torch's own converter, not the lesson): weights and
    momentum by name, and the epoch."""
    dcp_to_torch_save(path, tmp_path / "whole.pt")
    saved = torch.load(tmp_path / "whole.pt", weights_only=True)
    momentum = {f"{k}.momentum": v["momentum_buffer"] for k, v in saved["optim"]["state"].items()}
    return dict(saved["model"], **momentum), saved["epoch"]


def run_worker(prove, folder, epochs, resume=None, load=None):
    """lesson.worker as rank 0 of 1, in this process, unchanged but for the lab's wrappers (and
    `load` instead of the lesson's load_checkpoint); returns what the wrappers kept."""
    lesson, kept, threads = prove.lesson, {}, torch.get_num_threads()
    saved = lesson.train, lesson.load_checkpoint
    lesson.train = prove.keep_full_state(lesson.train, kept, "trained")
    lesson.load_checkpoint = prove.keep_full_state(load or lesson.load_checkpoint, kept, "loaded")
    try:
        lesson.worker(0, 1, prove.course.find_free_port(), "gloo", epochs, 16, 0.05, str(folder),
                      resume and str(resume), 30)
    finally:
        lesson.train, lesson.load_checkpoint = saved
        torch.set_num_threads(threads)
    assert not dist.is_initialized(), "the worker destroys its process group"
    return kept


def test_fully_shard_on_the_root_only_is_said_in_one_line(prove, tmp_path, monkeypatch):
    """README mistake 2, in a world of one in this process: the lesson's worker with fully_shard
    applied to the root only trains (and would pass), so the lab's check says it instead."""
    lesson, real = prove.lesson, prove.lesson.fully_shard
    monkeypatch.setattr(lesson, "fully_shard", lambda module, **kwargs: real(module, **kwargs)
                        if isinstance(module, torch.nn.Sequential) else module)
    monkeypatch.setattr(lesson, "train", prove.checking_the_optimizer(lesson.train))
    threads = torch.get_num_threads()
    try:
        with pytest.raises(RuntimeError, match=r"layer\(s\) 0, 2 are not fully_shard units"):
            lesson.worker(0, 1, prove.course.find_free_port(), "gloo", 1, 16, 0.05, str(tmp_path),
                          None, 30)
    finally:
        torch.set_num_threads(threads)
    assert not dist.is_initialized(), "the worker destroys its process group"


class TestTheLessonCopiedAlone:
    """The tests that read the one run of the lesson copied alone (the `alone` fixture): a
    class, so that pytest-xdist keeps them on one worker (conftest.py) and the lesson runs once."""

    def test_the_lesson_copied_alone_runs_and_saves_a_checkpoint_per_epoch(self, alone):
        result, ckpt = alone
        assert result.returncode == 0, result.stderr[-3000:]
        assert "no checkpoint in ckpt_fsdp: from epoch 0" in result.stdout
        assert "saved ckpt_fsdp/epoch0001" in result.stdout and "saved ckpt_fsdp/epoch0002" in result.stdout
        assert sorted(os.listdir(ckpt)) == ["epoch0001", "epoch0002"], "no .tmp left behind"
        assert sorted(os.listdir(ckpt / "epoch0001")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    def test_two_ranks_trained_like_one_process(self, prove, alone, tmp_path):
        state, epoch = saved_state(alone[1] / "epoch0002", tmp_path)
        assert epoch == 2
        assert prove.course.max_abs_diff(prove.weights(state), prove.train_reference([2, 2], 16, 0.05)) \
            <= TOLERANCE

    def test_what_two_ranks_saved_loads_on_one_rank_exactly_and_trains_on(self, prove, alone, tmp_path):
        shutil.copytree(alone[1] / "epoch0001", tmp_path / "run" / "epoch0001")
        kept = run_worker(prove, tmp_path / "run", epochs=2, resume=tmp_path / "run" / "epoch0001")
        state, epoch = saved_state(alone[1] / "epoch0001", tmp_path)
        assert epoch == 1 and set(kept["loaded"]) == set(state) and len(state) == 8
        assert prove.course.max_abs_diff(kept["loaded"], state) == 0.0, "every weight and momentum value"
        reference = prove.train_reference([2, 1], 16, 0.05)  # epoch 0 on 2 ranks, epoch 1 on 1
        assert prove.course.max_abs_diff(prove.weights(kept["trained"]), reference) <= TOLERANCE
        assert sorted(os.listdir(tmp_path / "run" / "epoch0002")) == [".metadata", "__0_0.distcp"]

    def test_the_model_only_break_loses_the_momentum(self, prove, alone, tmp_path, monkeypatch,
                                                     capsys):
        """The lab's own rank function, as a resumed run of one rank, in this process: under
        --break model-only-checkpoint the weights come back, the momentum does not."""
        for name in ("train", "save_checkpoint", "load_checkpoint"):  # lab_worker wraps them: undo
            monkeypatch.setattr(prove.lesson, name, getattr(prove.lesson, name))
        monkeypatch.chdir(tmp_path)  # lab_worker changes into its folder
        shutil.copytree(alone[1] / "epoch0001", tmp_path / "on1" / "epoch0001")
        job = dict(rank=0, world_size=1, port=prove.course.find_free_port(), folder="on1",
                   resume=os.path.join("on1", "epoch0001"), ddp_port=None)
        threads = torch.get_num_threads()
        try:
            prove.lab_worker(0, [job], "gloo", 2, 16, 0.05, str(tmp_path), "model-only-checkpoint",
                             None, 30)
        finally:
            torch.set_num_threads(threads)
        loaded = torch.load(tmp_path / "on1.pt", map_location="cpu", weights_only=True)["loaded"]
        saved, _ = saved_state(alone[1] / "epoch0001", tmp_path)
        assert all(torch.equal(loaded[k], saved[k]) for k in prove.weights(saved)), "weights: yes"
        momentum = [k for k in saved if k.endswith(".momentum")]
        assert momentum and all(saved[k].abs().max() > 0 and loaded[k].abs().max() == 0 for k in momentum)
        weights = prove.weights(saved)  # the training itself right: the cause is the checkpoint's
        runs = {"fsdp": {"trained": weights, "ddp": weights, "saved at 1": saved, "steps": [8, 8]},
                "on1": {"loaded": loaded}}
        capsys.readouterr()
        prove.likely_cause(runs, 2, 1, [1])
        assert capsys.readouterr().out.startswith(
            "LIKELY CAUSE: the checkpoint holds the model only: the weights load exactly, but every "
            "momentum buffer comes back 0 (saved: up to ")

    @pytest.mark.parametrize("damage, message", [
        ("remove .metadata", "No such file or directory"),
        ("garble .metadata", "is not a complete DCP checkpoint"),
        ("remove a shard", "__1_0.distcp"),
        ("truncate a shard", "__1_0.distcp is truncated"),
    ])
    def test_a_damaged_checkpoint_stops_the_run_with_one_line_and_changes_nothing(self, 
            prove, alone, tmp_path, monkeypatch, damage, message):
        ckpt = tmp_path / "run"
        shutil.copytree(alone[1], ckpt)
        newest = ckpt / "epoch0002"
        if damage == "remove .metadata":
            os.remove(newest / ".metadata")
        elif damage == "garble .metadata":
            (newest / ".metadata").write_bytes(b"not a pickle")
        elif damage == "remove a shard":
            os.remove(newest / "__1_0.distcp")
        else:
            with open(newest / "__1_0.distcp", "r+b") as f:
                f.truncate(100)
        shutil.copytree(ckpt, tmp_path / "before")
        monkeypatch.setattr(prove.lesson.mp, "spawn", lambda *a, **k: pytest.fail("a rank started"))
        with pytest.raises(SystemExit) as exit_:
            prove.lesson.main(world_size=1, epochs=3, folder=str(ckpt))
        text = str(exit_.value.code)
        assert "epoch0002 is not a complete DCP checkpoint" in text and message in text
        assert "\n" not in text, "one line"
        same = filecmp.dircmp(ckpt, tmp_path / "before")
        assert not (same.left_only or same.right_only or same.diff_files), "nothing changed"
        assert sorted(os.listdir(newest)) == sorted(os.listdir(tmp_path / "before" / "epoch0002"))

    def test_an_unfinished_save_is_not_a_checkpoint(self, prove, alone, tmp_path):
        """A crash mid-save leaves epochNNNN.tmp (renamed only once complete): never loaded."""
        shutil.copytree(alone[1] / "epoch0001", tmp_path / "epoch0001")
        shutil.copytree(alone[1] / "epoch0002", tmp_path / "epoch0002.tmp")
        os.remove(tmp_path / "epoch0002.tmp" / ".metadata")
        assert prove.lesson.find_checkpoint(str(tmp_path)) == str(tmp_path / "epoch0001")
        assert prove.lesson.find_checkpoint(str(alone[1])) == str(alone[1] / "epoch0002"), "the newest"
        assert prove.lesson.find_checkpoint(str(tmp_path / "nothing here")) is None

    def test_a_crashed_saves_tmp_folder_is_removed_before_any_rank_starts(self, prove, alone, tmp_path,
                                                                          monkeypatch, capsys):
        """main() clears every epochNNNN.tmp, so that a later save cannot rename a crashed one's stray
        files in with its own; the complete checkpoints stay, and the newest is resumed."""
        shutil.copytree(alone[1] / "epoch0001", tmp_path / "epoch0001")
        shutil.copytree(alone[1] / "epoch0001", tmp_path / "epoch0002.tmp")  # a save that crashed
        (tmp_path / "epoch0002.tmp" / "__2_0.distcp").write_bytes(b"a larger world's shard")
        before = {p.name: p.read_bytes() for p in (tmp_path / "epoch0001").iterdir()}
        started = []
        monkeypatch.setattr(prove.lesson.mp, "spawn", lambda worker, args, **kw: started.append(args))
        prove.lesson.main(world_size=2, epochs=3, folder=str(tmp_path))
        assert sorted(os.listdir(tmp_path)) == ["epoch0001"], "the unfinished save is gone"
        assert {p.name: p.read_bytes() for p in (tmp_path / "epoch0001").iterdir()} == before
        assert started and started[0][-1] == str(tmp_path / "epoch0001"), "ranks resume the newest"
        assert f"resuming from {tmp_path / 'epoch0001'}" in capsys.readouterr().out

# --- the lab's reference, in-process -------------------------------------------------------------

@pytest.mark.parametrize("world_sizes, batch_size", [([2, 3], 16), ([3, 1], 7), ([4], 5)])
def test_global_batches_are_the_ranks_batches_concatenated(prove, world_sizes, batch_size):
    """At every step of epoch e, the reference's batch is rank 0's, then rank 1's, ... of
    world_sizes[e] ranks, exactly as the lesson's DataLoaders give them (padding included)."""
    dataset = TensorDataset(torch.arange(50))
    reference = DataLoader(dataset, batch_sampler=prove.GlobalBatches(dataset, world_sizes, batch_size))
    for epoch, n in enumerate(world_sizes):
        samplers = [DistributedSampler(dataset, num_replicas=n, rank=r, seed=0) for r in range(n)]
        for sampler in samplers:
            sampler.set_epoch(epoch)
        loaders = [DataLoader(dataset, batch_size=batch_size, sampler=s) for s in samplers]
        global_batches = iter(reference)  # one pass per epoch, as lesson 00's loop makes
        for per_rank in zip(*loaders):
            assert torch.equal(next(global_batches)[0], torch.cat([b[0] for b in per_rank]))
        assert next(global_batches, None) is None


# --- the memory table: memory.py's committed results, quoted by the README ------------------------

def test_the_memory_table_is_what_memory_json_holds():
    """memory.py is not run here (NOTES.md says how long it takes); a re-run that changes its
    results must change the table too (NOTES.md, section 1; the README points to it)."""
    measured = json.loads((REPO / "07_fsdp_dcp" / "memory.json").read_text())["rows"]
    readme = (REPO / "07_fsdp_dcp" / "NOTES.md").read_text()
    shown = re.findall(r"^\| (\d+) \| ([\d.]+) MiB \| ([\d.]+) MiB \| ([\d.]+) \| [\d.]+ \| "
                       r"(\d+) / (\d+) MiB \|$", readme, re.M)
    assert [int(row[0]) for row in shown] == [row["N"] for row in measured] == [1, 2, 4]
    for row, json_row in zip(shown, measured):
        ddp, fsdp = (max(json_row[kind]["per_rank_total"]) for kind in ("ddp", "fsdp2"))
        rss = (f"{json_row[kind]['rss_growth_trimmed_mib']:.0f}" for kind in ("ddp", "fsdp2"))
        expected = (f"{ddp / 2**20:.1f}", f"{fsdp / 2**20:.1f}", f"{fsdp / ddp:.4f}", *rss)
        assert row[1:] == expected, f"NOTES row N={row[0]} should read {expected} (memory.json)"
        assert abs(fsdp / ddp - 1 / json_row["N"]) < 0.001, "FSDP2 holds 1/N of DDP's bytes"


# --- guard rails and help, in-process ------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--world-size", "0"], "must be positive"),
    (["--resume-on", "1", "0"], "must be positive"),
    (["--resume-on", "3", "3"], "--resume-on: name each world size once"),
    (["--lr", "-1"], "must be positive"),
    (["--epochs", "1"], "--epochs must be 2 or more"),
    (["--crash-rank", "2"], "--crash-rank must be a rank from 0 to 1"),
    (["--out-dir", "07_fsdp_dcp"], "--out-dir 07_fsdp_dcp is not an empty folder"),
    (["--break", "nothing"], "invalid choice: 'nothing'"),
])
def test_impossible_choices_are_refused_before_any_rank_starts(prove, capsys, monkeypatch, args,
                                                              message):
    monkeypatch.chdir(REPO)
    stderr = assert_refused_in_process(prove.parse_args, args, capsys, message)
    assert stderr.count("\n") == 1 or "invalid choice" in message  # argparse adds its usage


def test_help_names_every_flag_and_break(prove, capsys):
    assert_help_in_process(prove.parse_args, ["--world-size", "--resume-on", "--epochs", "--batch-size", "--lr",
                                              "--device", "--break", "--crash-rank", "--timeout", "--out-dir",
                                              *prove.BREAKS], capsys)


def test_cuda_without_gpus_is_refused(prove, capsys):
    if torch.cuda.device_count() >= 3:
        pytest.skip("this machine has a GPU for each rank")
    with pytest.raises(SystemExit) as exit_:
        prove.main(["--device", "cuda"])
    assert exit_.value.code == 2
    assert "--device cuda needs one GPU per rank" in capsys.readouterr().err


# --- the memory benchmark (memory.py) and the table NOTES.md quotes -------------------------------

def test_memory_json_shows_fsdp2_at_one_nth_of_ddp_and_notes_quote_it():
    result = json.loads((REPO / "07_fsdp_dcp/memory.json").read_text())
    notes = (REPO / "07_fsdp_dcp/NOTES.md").read_text()
    rows = {row["N"]: row for row in result["rows"]}
    assert sorted(rows) == [1, 2, 4]
    full = result["model"]["param_bytes"]
    for n, row in rows.items():
        ddp, fsdp2 = row["ddp"], row["fsdp2"]
        assert ddp["params"] == ddp["grads"] == full and ddp["optim"] >= 2 * full
        assert set(ddp["per_rank_total"]) == {ddp["total"]}
        measured = max(fsdp2["per_rank_total"]) / max(ddp["per_rank_total"])
        assert row["ratio"] == pytest.approx(measured)
        assert 1 / n <= row["ratio"] <= 1 / n * 1.001, (n, row["ratio"])
        assert fsdp2["params"] >= full / n and fsdp2["grads"] >= full / n
        assert (sum(fsdp2["per_rank_padding"]) > 0) == (10 % n != 0)
        assert fsdp2["params"] == row["fsdp2_meta"]["params"], "meta init changes no byte count"
        quoted = rf"\|\s*{n}\s*\|\s*FSDP2\s*\|\s*{fsdp2['params'] / MiB:.2f}\s*\|"
        assert re.search(quoted, notes), f"NOTES.md's table lacks {quoted}"
        assert f"{row['ratio']:.4f}" in notes
    assert f"{rows[4]['fsdp2']['per_rank_padding'][-1]:,} bytes" in notes


def test_memory_benchmark_counts_shards_padding_and_views(tmp_path):
    memory = load_script("07_fsdp_dcp/memory.py")
    flat = torch.zeros(12)
    assert memory.storage_bytes([flat[:4], flat[4:]]) == 48  # two views of one buffer: once
    assert memory.shard_bytes([flat[:4], flat[4:]]) == 48
    assert memory.storage_bytes([flat[:3]]) == 48 and memory.shard_bytes([flat[:3]]) == 12
    threads = torch.get_num_threads()
    try:
        for wrapper in ("ddp", "fsdp2"):
            memory.measure(0, 1, memory.course.find_free_port(), wrapper, 8, 2, str(tmp_path))
    finally:
        torch.set_num_threads(threads)  # measure() sets 1 thread for its rank
    ddp, fsdp2 = (json.loads((tmp_path / f"{w}_1_0.json").read_text()) for w in ("ddp", "fsdp2"))
    params = sum(p.numel() for p in memory.make_model(8, 2).parameters()) * 4
    assert ddp["params"] == ddp["grads"] == fsdp2["params"] == fsdp2["grads"] == params
    assert ddp["total"] == fsdp2["total"] == 4 * params + 4 * 6  # + 6 AdamW step counters


@pytest.mark.parametrize("argv", [["--world-sizes", "2,x"], ["--world-sizes", "0"],
                                  ["--width", "0"], ["--out-dir", "/no/such/folder"]])
def test_memory_benchmark_refuses_bad_input_before_any_rank(monkeypatch, capsys, argv):
    memory = load_script("07_fsdp_dcp/memory.py")
    monkeypatch.setattr(sys, "argv", ["memory.py", *argv])
    monkeypatch.setattr(memory, "run_all", lambda *a: pytest.fail("a rank started"))
    with pytest.raises(SystemExit) as stop:
        memory.main()
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("memory.py: error: ") and len(err.splitlines()) == 1


def test_memory_benchmark_without_proc_counts_the_bytes_and_says_rss_is_not_measured(tmp_path, monkeypatch,
                                                                                     capsys):
    """macOS and Windows have no /proc/self/status: the tensor bytes are still exact; the RSS
    columns read n/a, memory.json holds null, the plot leaves the RSS lines out, and the run says so
    in one line. The ranks run in this process (a world of one), as in the test above."""
    memory = load_script("07_fsdp_dcp/memory.py")
    monkeypatch.setattr(memory, "STATUS", str(tmp_path / "no-proc" / "status"))
    monkeypatch.setattr(memory.course, "spawn_or_fail", lambda fn, args, nprocs: fn(0, *args))
    monkeypatch.setattr(sys, "argv", ["memory.py", "--world-sizes", "1", "--width", "8",
                                      "--out-dir", str(tmp_path), "--plot"])
    threads = torch.get_num_threads()
    try:
        memory.main()
    finally:
        torch.set_num_threads(threads)  # measure() sets 1 thread for its rank
    out = capsys.readouterr().out
    notice = [line for line in out.splitlines() if line.startswith("RSS: not measured on")]
    assert len(notice) == 1 and "/proc/self/status is Linux only" in notice[0]
    rows = [line.split() for line in out.splitlines() if line.startswith(" 1 ")]
    assert len(rows) == 3 and all(row[-2:] == ["n/a", "n/a"] for row in rows), out
    result = json.loads((tmp_path / "memory.json").read_text())
    ddp = result["rows"][0]["ddp"]
    assert ddp["rss_mib"] is ddp["rss_growth_mib"] is ddp["rss_growth_trimmed_mib"] is None
    params = sum(p.numel() for p in memory.make_model(8, 4).parameters()) * 4
    assert ddp["params"] == ddp["grads"] == params and ddp["total"] == 4 * params + 4 * 10
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"
    assert memory.mib(12.4, 6) == f"{12.4:6.0f}" and memory.mib(None, 7) == "    n/a"  # Linux unchanged
