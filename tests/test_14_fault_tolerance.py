"""Lesson 14 and its lab: torchft's replica groups survive a SIGKILLed replica (no restart of the
others, every step committed once, the stall the join timeout, the returning replica healed and
bit-identical), a failed all-reduce's step is discarded, and dcp.async_save's checkpoint equals
the weights at the call while a save cut short by a death is never loaded.

Command-line runs are what a user sees (the lab's proof, its --breaks in two launches, a crashed replica, the
lesson copied alone); the pieces (the Lighthouse, the resume's choice, the batches) in-process."""
import json
import os
import re
import shutil
import sys

import pytest
import torch

from conftest import (REPO, assert_crashed_rank_stops_the_run, assert_help_in_process,
                      assert_refused_in_process, last_line_matching, load_script,
                      run_readme_command)

LAB = "14_fault_tolerance/prove.py"
LESSON = "14_fault_tolerance/fault_tolerance.py"
ELASTIC = "14_fault_tolerance/elastic.py"
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def prove():
    return load_script(LAB)


# --- the lab, run as the README runs it ---------------------------------------------------------

def test_the_default_run_proves_every_claim():
    result = run_readme_command(f"python {LAB}")  # the same run the README output test reads
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert last_line_matching(r"^PROOF ", out).startswith("PROOF PASSED")
    lives = re.findall(r"replica (\d) (\d+)/(\d+)/(\d+)", last_line_matching("per process", out))
    assert [r for r, *_ in lives] == ["0", "1", "2", "2"], "3 processes and one restart"
    assert all(committed == applied for _, committed, applied, _ in lives)
    assert [int(d) for *_, d in lives] == [0, 1, 0, 0], "replica 1's failed all-reduce, discarded"
    assert int(lives[0][1]) >= 55, "a survivor commits every step (from step 1 if it joined late)"
    runs = re.findall(r"(\d) x (\d+)", last_line_matching("participants per step", out))
    assert sum(int(n) for _, n in runs) == int(lives[0][1]), "a step, a row of replica 0's log"
    assert "3" in [p for p, _ in runs], "(a 2-replica stretch only if the return is slow)"
    stall = float(re.search(r"the stall .*?: (\S+) s", out)[1])
    assert 0.8 <= stall <= 3.0
    kill = int(re.search(r"after its backward at step (\d+)", out)[1])
    first = int(re.search(r"its first step is (\d+)", out)[1])
    assert first > kill, "the returning replica starts at the current step, not 0"
    assert "between the 3 replicas at the end: 0.0" in out
    assert "against the weights at the call: 0.0 (the weights had moved" in out
    assert "exit codes [-9, -9]" in out and "no .metadata" in out
    assert "the resume chose step-2; its weights against step 2's: 0.0" in out


def test_three_breaks_in_one_launch_each_fail_their_own_part():
    """commit-anyway (torchft), load-newest (checkpoints) and shared-store (elastic torchrun): one
    launch for three, the README's; each fails its own claim with its own cause, and
    commit-anyway leaves the heal alone (no-heal's cause does not fit)."""
    result = run_readme_command(f"python {LAB} --break commit-anyway load-newest shared-store")
    assert result.returncode == 1, result.stderr[-3000:]
    out = result.stdout
    # one optimizer step more than its commits: the discarded step applied (how many steps
    # replica 1 commits depends on the load: 59, or 58 when it joined a step late)
    counts = re.search(r"replica 1 (\d+)/(\d+)/1", out)
    assert counts and int(counts[2]) == int(counts[1]) + 1, "the discarded step applied"
    assert re.search(r"against replica 0: replica 1 \S+, replica 2 0\.0\)", out), "healed"
    assert "the resume chose step-5: loading it raised" in out
    assert re.search(r"world size per step: 1 x 20;", out), "node A alone, then nothing"
    assert "node A's agent raised DistStoreError: it waited 10 s for role_info" in out
    assert "node B's agent raised DistStoreError: it waited 10 s for MASTER_ADDR" in out
    assert "processes left running: 0" in out
    causes = out.splitlines()[-1]
    assert causes.startswith("LIKELY CAUSE: an optimizer step outside should_commit()"), causes
    assert "; and the resume loaded a checkpoint that was never finished" in causes
    assert "; and node B joined and the two agents waited for each other" in causes
    assert "did not load its peer's weights" not in causes, "commit-anyway broke the heal"


def test_the_no_heal_break_leaves_the_replicas_apart():
    result = run_readme_command(f"python {LAB} --break no-heal")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "asynchronous checkpoints" not in result.stdout, "a --break runs the part it breaks"
    apart = float(re.search(r"between the 3 replicas at the end: (\S+)", result.stdout)[1])
    returning = float(re.search(r"against replica 0: replica 1 \S+, replica 2 (\S+)\)",
                                result.stdout)[1])
    assert apart > 0 and returning > 0, "the returning replica kept its own weights"
    assert re.search(r"replica 1 (\d+)/\1/1", result.stdout), "no step outside a commit"
    assert result.stdout.splitlines()[-1].startswith(
        "LIKELY CAUSE: a replica that healed did not load its peer's weights")


def test_the_elastic_run_takes_every_step_once_on_any_world_size():
    out = run_readme_command(f"python {LAB}").stdout  # the default run, which holds this claim
    runs = re.findall(r"(\d) x (\d+)", re.search(r"^  world size per step: (.*?);", out, re.M)[1])
    assert [int(n) for n, _ in runs] == [1, 2, 1], "node B joins, then is lost"
    assert [int(c) for _, c in runs] == [20, 15, 25], "the lab's pauses at steps 20 and 35"
    assert "steps logged: 60, 0..59 each once" in out
    apart = float(re.search(r"on the same 60 global batches \(float64\): (\S+);", out)[1])
    losses = float(re.search(r"\(float64\): \S+; logged losses: (\S+)$", out, re.M)[1])
    assert apart <= 1e-9 and losses <= 1e-9, "the weights and losses of one process"
    assert "node A's agent exit code 0; processes left running: 0" in out
    assert "agent raised DistStoreError" not in out


def test_a_crashed_replica_stops_the_run(lesson):
    assert_crashed_rank_stops_the_run(lesson, LAB)


# --- the lesson alone ------------------------------------------------------------------------------

def test_the_lesson_copied_alone_trains_two_replicas_alike(lesson, tmp_path, monkeypatch):
    monkeypatch.delenv("RUST_LOG", raising=False)  # a user's shell; the lab's import sets it here
    shutil.copy(REPO / LESSON, tmp_path / "fault_tolerance.py")
    result = lesson.run(tmp_path / "fault_tolerance.py", "--replicas", 2, "--steps", 6,
                        cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^2 replicas, 6 steps committed, accuracy \d+/256; weights apart between "
                     r"replicas: 0\.0$", result.stdout, re.M), result.stdout
    assert os.listdir(tmp_path) == ["fault_tolerance.py"], "its files go to a temporary folder"
    quorums = re.findall(r".*\[INFO\] \[torchft::.*", result.stdout + result.stderr)
    assert not quorums, f"RUST_LOG set after torchft loaded: {len(quorums)} lines, {quorums[:1]}"


def test_the_elastic_lesson_copied_alone_runs_as_a_world_of_one(lesson, tmp_path):
    """One run (each start costs about 8 s): a resume from its file is the in-process test's
    below, and a resume in a new process the lab's proof (node A's restarted worker)."""
    shutil.copy(REPO / ELASTIC, tmp_path / "elastic.py")
    result = lesson.run(tmp_path / "elastic.py", "--steps", 5, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world size 1; resuming from None" in result.stdout
    assert "5 steps from step 0 on world size 1" in result.stdout
    log = (tmp_path / "elastic_checkpoints" / "steps.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in log] == [0, 1, 2, 3, 4]
    assert sorted(os.listdir(tmp_path / "elastic_checkpoints")) == [
        "step0000004.pt", "step0000005.pt", "steps.jsonl"], "the newest two, no temp file"


# --- the pieces, in-process ------------------------------------------------------------------------

def test_the_elastic_lesson_refuses_another_runs_checkpoint(prove, tmp_path, monkeypatch, capsys):
    """A --ckpt-dir saved with another --global-batch or --lr: a resume would take other windows
    or other updates (the optimizer's state brings back the old lr) and say nothing. In-process,
    a world of one: the refusal in one line, then the same settings resume."""
    world = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    for key, value in world.items():  # set here, so that main() leaves os.environ alone
        monkeypatch.setenv(key, value)
    main, folder = prove.elastic.main, str(tmp_path / "ckpt")
    main(steps=2, global_batch=32, lr=0.05, folder=folder, timeout=30)
    for other in (dict(global_batch=16, lr=0.05), dict(global_batch=32, lr=0.1)):
        mine = [other["global_batch"], other["lr"]]
        with pytest.raises(SystemExit, match=re.escape(
                f"step0000002.pt: saved with --global-batch, --lr [32, 0.05], not {mine}: resume "
                "only the same run")):
            main(steps=3, folder=folder, timeout=30, **other)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05)
    scheduled = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.1)  # a copier's
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.005) and \
        optimizer.defaults["lr"] == 0.05, \
        "the check reads defaults, which a scheduler leaves alone: a resume is not refused"
    main(steps=3, global_batch=32, lr=0.05, folder=folder, timeout=30)
    assert "1 steps from step 2 on world size 1" in capsys.readouterr().out
    del scheduled
    assert not prove.dist.is_initialized(), "every run destroys its process group"


def test_the_lighthouse_listens_on_a_free_port_and_shuts_down(prove):
    lighthouse = prove.lesson.start_lighthouse(1, 100)
    try:
        assert re.fullmatch(r"http://[^:]+:\d+", lighthouse.address())
    finally:
        lighthouse.shutdown()


def test_the_resume_skips_a_folder_without_metadata(prove, tmp_path):
    for step, done in ((2, True), (10, True), (11, False)):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / "__0_0.distcp").write_bytes(b"x")
        if done:
            (tmp_path / f"step-{step}" / ".metadata").write_bytes(b"m")
    assert prove.lesson.newest_complete(str(tmp_path)) == "step-10", "10 > 2: by number"
    assert prove.lesson.newest_complete(str(tmp_path / "step-11")) is None


def test_a_replicas_batch_is_the_same_in_any_process_and_its_own(prove):
    dataset = prove.lesson.make_dataset()
    x, y = prove.lesson.batch(dataset, 1, 7, 16)
    assert torch.equal(x, prove.lesson.batch(dataset, 1, 7, 16)[0])
    assert not torch.equal(x, prove.lesson.batch(dataset, 2, 7, 16)[0])
    assert y.shape == (16,)


def test_the_elastic_lessons_batch_and_log_do_not_depend_on_the_world_size(prove, tmp_path):
    e = prove.elastic
    whole = e.step_windows(256, 5, 48, seed=0)  # samples 240-287 of the stream: 2 epochs
    epochs = e.step_windows(256, 0, 512, seed=0)
    assert whole == epochs[240:288] and sorted(epochs[:256]) == list(range(256))
    assert epochs[:256] != epochs[256:], "a new permutation each epoch"
    assert sorted(whole[0::2] + whole[1::2]) == sorted(whole), "2 ranks share it, none twice"
    log = tmp_path / "steps.jsonl"
    for step in range(3):
        e.log_step(str(log), {"step": step, "world_size": 1, "loss": 1.0})
    e.log_step(str(log), {"step": 2, "world_size": 1, "loss": 1.0}, resumed=True)  # logged
    e.log_step(str(log), {"step": 3, "world_size": 2, "loss": 1.0}, resumed=True)  # missing
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [0, 1, 2, 3]


def test_the_elastic_lesson_keeps_the_lessons_limits():
    text = (REPO / ELASTIC).read_text()
    lines = text.splitlines()
    assert len(lines) <= 150 and max(map(len, lines)) <= 100
    assert len(re.findall(r"add_argument\(\s*[\"'](--[\w-]+)", text)) <= 5
    imported = set(re.findall(r"^(?:from|import) (\w+)", text, re.M))
    assert imported <= set(sys.stdlib_module_names) | {"torch"}, imported


# --- guard rails and help, in-process ----------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--kill-step", "0"], "--kill-step must be from 1 to --steps - 12 (48)"),
    (["--steps", "20", "--kill-step", "10"], "--kill-step must be from 1 to --steps - 12 (8)"),
    (["--crash-rank", "3"], "--crash-rank must be a rank from 0 to 2"),
    (["--break", "heal"], "invalid choice: 'heal'"),
    (["--break", "load-newest", "shared-store", "--crash-rank", "1"],  # it would prove nothing
     "--crash-rank crashes a replica: give it alone or with a --break of the replicas"),
])
def test_impossible_choices_are_refused_before_any_replica_starts(prove, capsys, args,
                                                                    message):
    assert_refused_in_process(prove.parse_args, args, capsys, message)


def test_help_names_every_flag_and_break(prove, capsys):
    assert_help_in_process(prove.parse_args, ["--steps", "--kill-step", "--timeout", "--break",
                                              "--crash-rank", "--lesson", *prove.BREAKS], capsys)
