"""Lesson 11, the capstone, and its lab: the lessons together on a GPT and real text.

The lab's whole proof and one break run once each as the README shows them (shared with the
README's output test); the other breaks, the data stream, the checkpoints' guard rails and the
lesson copied alone are tested here, in this process (a world of one) where no rank must start."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import uuid
from types import SimpleNamespace

import pytest
import torch

from conftest import (REPO, assert_help_in_process, assert_refused_in_process, kill_leftovers,
                      last_line_matching, load_script, run_lesson, run_once_per_session,
                      run_readme_command)

LAB = "11_train_gpt/prove.py"
FOLDER = REPO / "11_train_gpt"
pytestmark = pytest.mark.timeout(480)  # the whole proof: about 105 s alone on 2 cores


@pytest.fixture(scope="module")
def prove():
    return load_script(LAB)


@pytest.fixture(scope="module")
def lesson(prove):
    return prove.lesson


@pytest.fixture
def world_of_one(prove):
    """main() in this process sets torchrun's variables for a world of one: undo that after."""
    threads = torch.get_num_threads()
    prove.forget_world()
    yield
    prove.forget_world()
    torch.set_num_threads(threads)


# --- the lab, run as the README runs it ---------------------------------------------------------

def test_every_claim_holds_on_the_gpt():
    result = run_readme_command("python 11_train_gpt/prove.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    one = last_line_matching(r"^1\. float64", out)
    gaps = re.findall(r"\d\.\de[-+]\d\d", one)  # 4 runs' weights, then the gradient norms
    assert len(gaps) == 5 and max(map(float, gaps)) <= 1e-10, gaps
    assert one.endswith("micro-batches 1 and 2: DDP [0, 1], FSDP [0, 3]"), one  # K=2: once
    assert last_line_matching(r"^2\. killed", out).endswith(
        "DDP 0.0e+00, FSDP 0.0e+00; saves that made their files by renaming a whole temporary: "
        "DDP 3 of 3, FSDP 3 of 3")
    four = last_line_matching(r"^4\. ", out)
    counts = [item.split()[-1] for item in four.split("ranks): ", 1)[1].split(";")[0].split(", ")]
    total = re.search(r"of \d+ samples: (\d+)", out).group(1)
    assert counts and set(counts) == {total}, counts
    value = re.search(r"the mean loss at step 4 (\S+) from the lab's own sum", four).group(1)
    assert float(value) <= 1e-8, four
    assert last_line_matching(r"^5\. ", out).endswith("DDP [1, 2, 3, 4, 5, 6], FSDP [1, 2, 3, 4, 5, 6]")
    tp = last_line_matching(r"^7\. ", out)
    assert "20 of 36 parameter tensors split over the tp ranks" in tp, tp  # q, k, v, mlp.0: weight
    gaps = re.findall(r"\d\.\de[-+]\d\d", tp)  # and bias; proj, mlp.2: weight; in 2 blocks
    assert len(gaps) == 3 and max(map(float, gaps)) <= 1e-10, gaps
    assert tp.endswith("with dropout 0.1, a copy's 2 ranks' whole weights 0.0e+00 apart"), tp
    assert "4 ranks FSDP x TP 2 31040, 31040" in last_line_matching(r"^4\. ", out)
    assert "PROOF PASSED" in out


def test_autocast_on_the_wrong_device_fails_the_bf16_claim():
    result = run_readme_command("python 11_train_gpt/prove.py --break autocast-on-cuda")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "PROOF FAILED: NOT every claim holds (claim 6 fails)" in result.stdout
    assert "claim(s) 6 of 7" in result.stdout, "a break runs only the claims it breaks"
    cause = result.stdout.splitlines()[-1]
    assert cause.startswith("LIKELY CAUSE: autocast is off in DDP's bf16 run: it ends "), cause
    assert "from float64, where bf16's rounding moves it at least 0.0001" in cause, cause
    assert "torch.autocast(device.type, ...), as train_gpt.py line" in cause, cause


def test_tensor_parallelism_switched_off_is_equal_and_still_fails_claim_7():
    """Without the plan, each rank of a copy computes the whole model: equal to one process, and
    proving nothing about TP. Claim 7 counts the tensors split over the tp ranks too."""
    result = run_readme_command("python 11_train_gpt/prove.py --break no-tensor-parallel")
    assert result.returncode == 1, result.stderr[-3000:]
    line = last_line_matching(r"^7\. ", result.stdout)
    assert "0 of 36 parameter tensors split" in line, line
    assert max(map(float, re.findall(r"\d\.\de[-+]\d\d", line))) <= 1e-10, "equal, yet it fails"
    assert "PROOF FAILED: NOT every claim holds (claim 7 fails)" in result.stdout
    assert result.stdout.splitlines()[-1].startswith(
        "LIKELY CAUSE: the model's tensor_parallel() splits nothing: 0 of 36 parameter tensors")


# --- the data: one stream, whatever the world size ----------------------------------------------

def test_a_steps_windows_are_the_same_on_1_2_and_3_ranks(lesson):
    train_set = lesson.make_dataset(None, 64)[0]
    for step in (0, 7, len(train_set) // 24):  # the last one crosses an epoch's end
        expected = lesson.step_windows(len(train_set), step, 24, seed=0)
        for world, batch in ((1, 24), (2, 12), (3, 4)):
            accumulate = 24 // (world * batch)
            shares = [list(lesson.micro_batches(train_set, step, r, world, accumulate, batch, 0)
                           .sampler) for r in range(world)]
            assert sorted(sum(shares, [])) == sorted(expected), (step, world)


def test_a_module_that_became_a_package_is_read_from_its_init(lesson, tmp_path, monkeypatch):
    """CPython's source already has difflib as a package (Lib/difflib/__init__.py): a Python
    without difflib.py must still find the corpus."""
    for name in lesson.TRAIN_FILES + lesson.VAL_FILES:
        (tmp_path / name).write_bytes(name.encode() * 40)
    (tmp_path / "difflib.py").unlink()
    (tmp_path / "difflib").mkdir()
    (tmp_path / "difflib" / "__init__.py").write_bytes(b"package " * 40)
    monkeypatch.setattr(lesson.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    train_set, _, _ = lesson.make_dataset(None, 8)
    assert b"package " in bytes(train_set.tokens.tolist())


def test_an_epoch_sees_every_window_once_and_drops_none(lesson):
    n, batch = 100, 24  # 100 windows, steps of 24: epochs end mid-step
    stream = sum((lesson.step_windows(n, s, batch, seed=3) for s in range(25)), [])  # 6 epochs
    for epoch in range(6):
        assert sorted(stream[epoch * n:(epoch + 1) * n]) == list(range(n)), epoch
    assert stream[:n] != stream[n:2 * n], "a new order each epoch"


def test_rank_seeded_data_draws_other_windows_than_the_step(prove, lesson):
    train_set = lesson.make_dataset(None, 64)[0]
    two = sum((list(prove.rank_seeded_micro_batches(train_set, 1, r, 2, 1, 12, 0).sampler)
               for r in range(2)), [])
    assert sorted(two) != sorted(lesson.step_windows(len(train_set), 1, 24, 0))


def test_dropout_seeded_by_the_global_rank_drifts_a_copys_ranks_apart_and_fails_claim_7():
    """DDP's seed + 1 + rank under --tp: the weights a copy's two ranks both hold whole, which
    must stay equal, drift apart with dropout (the run itself ends without a complaint)."""
    marker = uuid.uuid4().hex
    result = run_lesson(LAB, "--break", "dropout-by-global-rank", timeout=300, marker=marker)
    assert not kill_leftovers(marker), "the lab left processes running"
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    line = last_line_matching(r"^7\. ", result.stdout)
    apart = float(re.search(r"whole weights (\S+) apart", line).group(1))
    assert apart > 1e-6, line
    assert "PROOF FAILED: NOT every claim holds (claim 7 fails)" in result.stdout
    assert result.stdout.splitlines()[-1].startswith(
        "LIKELY CAUSE: a copy's tp ranks draw different dropout masks: they end with different "
        "RNG states"), result.stdout[-1000:]


def test_data_by_global_rank_gives_a_copys_two_tp_ranks_different_windows(prove, lesson,
                                                                        monkeypatch):
    """--break data-by-global-rank: on 4 ranks with --tp 2, ranks 0 and 1 are copy 0's; the
    lesson gives both dp rank 0 of 2 (the same windows), the break their global ranks."""
    train_set, kept = lesson.make_dataset(None, 64)[0], {}
    windows = {}
    for broken in (None, "data-by-global-rank"):
        undo = prove.install(broken, False, 1, kept)
        try:
            for global_rank in (0, 1):
                monkeypatch.setattr(lesson.dist, "get_rank", lambda group=None, r=global_rank: r)
                monkeypatch.setattr(lesson.dist, "get_world_size", lambda group=None: 4)
                windows[broken, global_rank] = list(lesson.micro_batches(
                    train_set, 1, 0, 2, 1, 12, 0).sampler)  # what main passes: dp rank 0 of 2
        finally:
            undo()
    step = lesson.step_windows(len(train_set), 1, 24, 0)
    assert windows[None, 0] == windows[None, 1] == step[:12], "copy 0: the step's first half"
    assert windows["data-by-global-rank", 0] != windows["data-by-global-rank", 1]


# --- the lesson in this process: a world of one -------------------------------------------------

def test_evaluation_in_a_world_of_one_counts_every_target_once(prove, lesson, world_of_one,
                                                               tmp_path):
    kept = {}
    undo = prove.install(None, False, 1, kept)
    try:
        lesson.main(steps=1, every=1, batch_size=4, out_dir=str(tmp_path / "a"))
    finally:
        undo()
    val_set = lesson.make_dataset(None, 64)[1]
    assert kept["counted"] == [len(val_set) * 64]


def run_main(prove, folder, **settings):
    """The lesson's main() in a world of one, here; torchrun's variables removed after it."""
    try:
        return prove.lesson.main(out_dir=str(folder), batch_size=4, **settings)
    finally:
        prove.forget_world()


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_damaged_or_foreign_checkpoint_stops_with_one_line_and_changes_nothing(
        prove, world_of_one, tmp_path, capsys, monkeypatch, parallel):
    folder = tmp_path / "run"
    run_main(prove, folder, steps=2, every=1, parallel=parallel)
    saved = sorted(p.name for p in folder.iterdir() if p.name.startswith("step"))
    assert len(saved) == 2, saved  # this one and the one before it
    newest = folder / saved[-1]
    target = newest if newest.is_file() else next(newest.glob("__0_0.distcp"))
    data = target.read_bytes()

    def refused(message, **settings):
        before = {p: p.stat().st_mtime_ns for p in folder.rglob("*")}
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            run_main(prove, folder, **{"steps": 2, "every": 1, "parallel": parallel, **settings})
        err = capsys.readouterr().err
        assert stop.value.code == 2 and message in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert {p: p.stat().st_mtime_ns for p in folder.rglob("*")} == before, "nothing written"

    refused("was saved with other settings", lr=1e-3)  # foreign: another run's settings
    refused("was saved with other settings", steps=3)  # the cosine schedule would change
    refused("was saved by --parallel", parallel="fsdp" if parallel == "ddp" else "ddp")
    lesson, make_dataset, make_model = prove.lesson, prove.lesson.make_dataset, prove.lesson.GPT
    def edited_data(data, context):  # a code edit, the same sizes: the last window's last byte
        train_set, val_set, what = make_dataset(data, context)
        train_set.tokens = train_set.tokens.clone()
        train_set.tokens[len(train_set) * context] += 1
        return train_set, val_set, what
    monkeypatch.setattr(lesson, "make_dataset", edited_data)
    refused("was saved with other settings (saved, now: {'data': (")
    monkeypatch.setattr(lesson, "make_dataset", make_dataset)
    class Renamed(make_model):  # the same parameters, one renamed
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.final_norm = self.norm
            del self.norm
    Renamed.__name__ = make_model.__name__  # only the parameter's name differs
    monkeypatch.setattr(lesson, "GPT", Renamed)
    refused("was saved with other settings (saved, now: {'model': (")
    monkeypatch.setattr(lesson, "GPT", make_model)
    older = folder / saved[0]
    older_target = older if older.is_file() else next(older.glob("__0_0.distcp"))
    older_data = older_target.read_bytes()
    older_target.write_bytes(bytes(len(older_data)))  # nothing intact left to fall back on
    target.write_bytes(bytes(len(data)))  # zeroed
    refused("; no intact checkpoint before it")
    target.write_bytes(data[:len(data) // 2])  # truncated
    refused("is damaged")
    target.write_bytes(data)
    if parallel == "fsdp":  # a manifest that lists less than the folder holds checks too little
        manifest = newest / "sha256.txt"
        listed = manifest.read_text()
        manifest.write_text("")
        refused("does not list every file")
        manifest.write_text(listed)
    # whole again: it resumes at its last step, with nothing left to do
    assert run_main(prove, folder, steps=2, every=1, parallel=parallel)[2] == 2
    older_target.write_bytes(older_data)  # the one before whole, the newest damaged: DDP and FSDP
    target.write_bytes(bytes(len(data)))  # fall back to it, with a WARNING, and train again
    capsys.readouterr()
    assert run_main(prove, folder, steps=2, every=1, parallel=parallel)[2] == 1
    assert f"WARNING: {target} is damaged" in capsys.readouterr().err


@pytest.mark.parametrize("owner", ["a-live-process", "another-host"])
def test_a_second_job_on_a_folder_in_use_is_refused_and_changes_nothing(prove, world_of_one,
                                                                        tmp_path, capsys, owner):
    """Two jobs on one --out-dir would mix their checkpoints (issue 32, item 11): the folder's
    LOCK names a live process on this host (this test's parent), or another host (unknowable)."""
    folder = tmp_path / "run"
    folder.mkdir()
    held = f"{socket.gethostname()} {os.getppid()} none\n" if owner == "a-live-process" else \
        "node-that-is-not-this-one 12345 none\n"
    (folder / "LOCK").write_text(held)
    with pytest.raises(SystemExit) as stop:
        run_main(prove, folder, steps=1)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and f"{folder} is in use by another job" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert [p.name for p in folder.iterdir()] == ["LOCK"] and (folder / "LOCK").read_text() == held


def test_a_stale_lock_is_taken_over_and_a_finished_job_frees_its_folder(prove, world_of_one,
                                                                         tmp_path):
    """A lock whose process is gone (killed, never removed it), or an earlier attempt's of this
    same torchrun launch (a restart, maybe on another node), is stale; the end of a run removes
    its own. The optimizer decays the 2-D weights only (issue 32): its two groups, as saved."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now
    for held, launch in [(f"{socket.gethostname()} {gone.pid} none", None),
                         ("another-node 1 launch-7", "launch-7")]:
        folder = tmp_path / f"run-{launch}"
        folder.mkdir()
        (folder / "LOCK").write_text(held + "\n")
        if launch:
            os.environ["TORCHELASTIC_RUN_ID"] = launch
        try:
            run_main(prove, folder, steps=1)
        finally:
            os.environ.pop("TORCHELASTIC_RUN_ID", None)
        assert not (folder / "LOCK").exists()
    [saved] = folder.glob("step*.pt")
    groups = torch.load(saved, weights_only=True)["optimizer"]["param_groups"]
    model = prove.lesson.make_model(64, 0.0, 0)
    matrices = [n for n, p in model.named_parameters() if p.ndim >= 2]
    assert [(g["weight_decay"], len(g["params"])) for g in groups] == \
        [(0.1, len(matrices)), (0.0, len(list(model.parameters())) - len(matrices))]
    assert sorted(matrices) == sorted(n for n, _ in model.named_parameters()
                                      if "weight" in n and "norm" not in n), matrices


@pytest.mark.parametrize("settings, message", [
    (dict(tp=2, parallel="fsdp"), "--tp 2 must divide the 1 ranks"),
    (dict(tp=0, parallel="fsdp"), "--tp 0 must divide the 1 ranks"),
    (dict(tp=1, parallel="fsdp", world=2, heads=False), None),  # no plan needed without TP
    (dict(tp=2, world=2), "--tp 2 needs --parallel fsdp"),
    (dict(tp=2, parallel="fsdp", world=2, heads=False), "--tp 2 needs a method "
     "MLP.tensor_parallel(tp_mesh), as model.py's GPT"),
    (dict(tp=4, parallel="fsdp", world=4, heads=2), "--tp 4 must divide the heads"),
], ids=["above-the-world", "zero", "no-plan-no-tp", "without-fsdp", "a-model-without-a-plan",
        "more-than-the-heads"])
def test_a_bad_tp_stops_with_one_line_before_any_rank_starts(prove, lesson, world_of_one, tmp_path,
                                                              capsys, monkeypatch, settings,
                                                              message):
    """Each problem its own line, from rank 0, before the process group starts; a world of more
    than one is only pretended here (the check reads WORLD_SIZE), so nothing may get past it."""
    settings, heads = dict(settings), settings.get("heads")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(settings.pop("world", 1)),
                      LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    settings.pop("heads", None)
    if heads is False:  # a model of your own, without the plan or heads
        monkeypatch.setattr(lesson, "make_model", lambda *a: type("MLP", (torch.nn.Linear,), {})(2, 2))
    elif heads:
        monkeypatch.setattr(lesson, "make_model", lambda *a: lesson.GPT(n_head=heads))
    monkeypatch.setattr(lesson, "init_distributed", lambda *a: pytest.fail("the check let it by"))
    with pytest.raises((SystemExit, pytest.fail.Exception)) as stop:
        run_main(prove, tmp_path / "run", steps=1, **settings)
    err = capsys.readouterr().err
    if message is None:  # passed the check: it went on to start the process group
        assert stop.type is pytest.fail.Exception and not err, err
        return
    assert stop.type is SystemExit and stop.value.code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("copies_saved", [2, 3], ids=["same-copies", "other-copies"])
def test_a_resume_restores_or_reseeds_dropout_by_the_copy_not_the_rank(lesson, tmp_path,
                                                                      monkeypatch, copies_saved):
    """Rank 3 of 4 under --tp 2 is copy 1 of 2, as is rank 2: both must leave the checkpoint with
    copy 1's RNG state (saved by as many copies), or both with the same new seed (saved by
    another number), never rank 3's own: its dropout would drop other activations than rank 2."""
    net = lesson.make_model(64, 0.0, 0)
    optimizer = torch.optim.AdamW(net.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    states = [torch.Generator().manual_seed(100 + c).get_state() for c in range(copies_saved)]
    path = tmp_path / "step0000007.pt"
    torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "step": 7,
                "scheduler": scheduler.state_dict(), "config": {"seed": 0},
                "rng": [{"cpu": state, "cuda": None} for state in states]}, path)
    copies = object()  # the data-parallel group: rank 1 of 2 in it, rank 3 of 4 in the world
    monkeypatch.setattr(lesson.checkpoint.dist, "get_rank",
                        lambda group=None: 1 if group is copies else 3)
    monkeypatch.setattr(lesson.checkpoint.dist, "get_world_size",
                        lambda group=None: 2 if group is copies else 4)
    before = torch.get_rng_state()
    try:
        step = lesson.checkpoint.load(str(path), SimpleNamespace(module=net), optimizer, scheduler,
                                      "ddp", torch.device("cpu"), copies)
        restored = torch.get_rng_state()
    finally:
        torch.set_rng_state(before)
    reseeded = torch.Generator().manual_seed(0 + 1000 * 7 + 1).get_state()  # seed, step, copy
    expected = states[1] if copies_saved == 2 else reseeded
    assert step == 7 and torch.equal(restored, expected)


def test_a_crashed_saves_tmp_is_never_resumed(prove, world_of_one, tmp_path):
    folder = tmp_path / "run"
    run_main(prove, folder, steps=2, every=1, parallel="fsdp")
    os.rename(folder / "step0000002", folder / "step0000002.tmp")  # as if it crashed mid-save
    _, losses, start = run_main(prove, folder, steps=2, every=1, parallel="fsdp")
    assert start == 1 and len(losses) == 1
    assert not list(folder.glob("*.tmp")), "main() clears a crashed save's folder"


# --- adapting it: replace make_model and make_dataset, and the lab still proves it --------------

CNN = '''
def make_dataset(data, context):
    """torchvision's FakeData: 8x8 grey images in 4 classes, the same bytes in every process."""
    import torchvision
    to_tensor = torchvision.transforms.ToTensor()
    def images(size, offset):
        return [(to_tensor(x), y) for x, y in torchvision.datasets.FakeData(
            size, (1, 8, 8), 4, random_offset=offset)]
    return images(96, 0), images(37, 1000), "FakeData"


class CNN(torch.nn.Module):
    def __init__(self, dropout):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Conv2d(1, 4, 3), torch.nn.Conv2d(4, 4, 3)])
        self.drop, self.head = torch.nn.Dropout(dropout), torch.nn.Linear(4 * 4 * 4, 4)

    def forward(self, x):
        for block in self.blocks:
            x = F.max_pool2d(F.relu(block(x)), 1)
        return self.head(self.drop(x.flatten(1)))


def make_model(context, dropout, seed):
    torch.manual_seed(seed)
    return CNN(dropout)
'''

MSE = '''
def make_dataset(data, context):
    """A regression: y = x . w + noise, 10 features, 300 samples train and 89 validate."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(389, 10, generator=g), torch.randn(10, generator=g)
    pairs = list(zip(x, x @ w + 0.1 * torch.randn(389, generator=g)))
    return pairs[:300], pairs[300:], "synthetic regression"


class MLP(torch.nn.Module):
    def __init__(self, dropout):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(
            torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Dropout(dropout))])
        self.head = torch.nn.Linear(32, 1)  # (B, 1) for targets (B,): the loss views it as (B,)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_model(context, dropout, seed):
    torch.manual_seed(seed)
    return MLP(dropout)
'''


def copy_of_the_lesson(folder, functions, edits=()):
    """The README's recipe: the folder copied, make_dataset and make_model replaced (and, for a
    mistake, `edits`: (old, new) texts of the script)."""
    shutil.copytree(FOLDER, folder, ignore=shutil.ignore_patterns("prove.py", "*.md", "*.png",
                                                                  "__pycache__", "*.sbatch"))
    script = (folder / "train_gpt.py").read_text()
    start, end = script.index("def make_dataset("), script.index("def step_windows(")
    script = script[:start] + functions.lstrip() + "\n\n" + script[end:]
    for old, new in edits:
        assert script.count(old) == 1, old
        script = script.replace(old, new)
    (folder / "train_copy.py").write_text(script)
    return folder / "train_copy.py"


def test_a_cnn_on_fakedata_replaces_two_functions_and_the_lab_still_proves_it(tmp_path):
    """The README's recipe: copy the folder, replace make_dataset and make_model, nothing else;
    the lab then proves every claim on the copy with no flag (claim 7 skipped: no plan for --tp),
    and F stays torch's whole module (F.relu, F.max_pool2d) under the lab."""
    run_once_per_session("test_11_train_gpt.cnn")
    copy = copy_of_the_lesson(tmp_path / "my_project", CNN)
    marker = uuid.uuid4().hex
    result = run_lesson(LAB, "--lesson", copy, timeout=300, marker=marker)
    assert not kill_leftovers(marker), "the lab left processes running"
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "of 37 samples: 37" in result.stdout and "PROOF PASSED" in result.stdout
    assert "7. skipped: the model has no tensor_parallel()\n" in result.stdout


def test_a_regression_with_squared_error_replaces_two_functions_and_the_lab_proves_it(tmp_path):
    """Real-valued targets: the lesson's loss is the squared error, its output viewed as the
    target; claim 4 checks the evaluation's value, not only its count."""
    copy = copy_of_the_lesson(tmp_path / "regression", MSE)
    marker = uuid.uuid4().hex
    result = run_lesson(LAB, "--lesson", copy, "--claims", 1, 4, timeout=300, marker=marker)
    assert not kill_leftovers(marker), "the lab left processes running"
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "of 89 samples: 89" in result.stdout and "PROOF PASSED" in result.stdout


@pytest.fixture
def graded(prove, world_of_one, tmp_path):
    """Grades a copy of the lesson in this process (a world of one): the lab's lesson swapped for
    the copy, and back, the same module object, after the test."""
    before = prove.lesson, {name: sys.modules.get(name) for name in ("model", "checkpoint")}
    path = list(sys.path)

    def grade(functions, edits=(), checkpoint_edits=()):
        copy = copy_of_the_lesson(tmp_path / f"copy{len(os.listdir(tmp_path))}", functions, edits)
        source = (copy.parent / "checkpoint.py").read_text()
        for old, new in checkpoint_edits:
            assert source.count(old) == 1, old
            source = source.replace(old, new)
        (copy.parent / "checkpoint.py").write_text(source)
        prove.use_lesson(str(copy))
        return copy
    yield grade
    prove.lesson, sys.path[:] = before[0], path
    for name, module in before[1].items():
        sys.modules[name] = module


def one_process(prove, tmp_path, capsys, **settings):
    """The lab's one-process run of claims 1 and 4, here: what it measured."""
    out = tmp_path / "lab"
    out.mkdir(exist_ok=True)
    settings = {"batch_size": 24, **settings}
    kept = prove.in_this_process("one", prove.job("one", str(out), **settings), None, str(out))
    capsys.readouterr()
    return kept


def test_an_evaluation_that_adds_up_a_mean_per_batch_is_named(prove, graded, tmp_path, capsys):
    """reduction left at "mean" in evaluate: every target counted, the value wrong (the issue's
    0.0136 for 0.5786). The lab's own sum over every target, in this process, names it."""
    graded(MSE, [('loss_fn(logits, y.to(device), reduction="sum")',
                  "loss_fn(logits, y.to(device))")])
    kept = one_process(prove, tmp_path, capsys)
    value, forwards = kept["evaluated"][-1]
    val_set = prove.lesson.make_dataset(None, 64)[1]
    exact = prove.exact_evaluation(kept, val_set, 64)
    assert kept["counted"] == [89] and forwards == 1 and abs(value * 89 - exact) < 1e-9 * exact
    fits, cause = prove.mean_reduction_cause(value, forwards, exact, 89)
    assert fits and cause.startswith(
        f"evaluation adds up a mean per forward: one process reports {value:.4f}, the mean over "
        f"the targets is {exact:.4f} ({value / exact:.4f} of it = 1 forward(s) / 89 "
        f"targets)"), cause


def test_a_loss_that_broadcasts_b_1_against_b_is_named(prove, graded, tmp_path, capsys):
    """mse_loss of a (B, 1) output against (B,) targets is a (B, B) loss: it trains, exits 0 and
    passes a count; torch's warning, which the lab records, names it."""
    graded(MSE, [("output.view(target.shape)", "output")])
    kept = one_process(prove, tmp_path, capsys)
    fits, cause = prove.broadcast_cause(kept["warnings"])
    assert fits and cause.startswith(
        'the loss broadcasts the output against the target: torch warned "Using a target size '
        "(torch.Size([24])) that is different to the input size (torch.Size([24, 1]))"), cause


def test_main_without_a_world_of_one_is_named_before_any_rank_starts(prove, graded, tmp_path,
                                                                       capsys):
    script = (FOLDER / "train_gpt.py").read_text()
    block = script[script.index('    if "RANK" not in os.environ:'):
                   script.index("    rank, world_size = int(")]
    graded(CNN, [(block, "")])
    with pytest.raises(prove.Diagnosed) as failed:
        one_process(prove, tmp_path, capsys)
    assert failed.value.args[1].startswith(
        "no world-of-one set-up for plain python: main(), run with no torchrun variable in the "
        "environment, raised KeyError: 'RANK'"), failed.value.args[1]


def test_a_checkpoint_written_in_place_fails_claim_2_with_its_cause(prove, graded, tmp_path,
                                                                    capsys):
    """checkpoint.py writing the file it resumes from directly, no .tmp and rename: the lab sees
    the save make its file with no os.replace or os.rename."""
    graded(CNN, checkpoint_edits=[('with open(path + ".tmp", "wb") as f:',
                                   'with open(path, "wb") as f:'),
                                  ('fsync_rename(path + ".tmp", path)', "pass")])
    kept = one_process(prove, tmp_path, capsys, **prove.RESTART)
    assert kept["saves"][0][1] and kept["saves"][0][2] == [], kept["saves"]
    runs = {"one": kept, "ddp-uninterrupted": kept, "fsdp-uninterrupted": kept}
    code = prove.report({2}, runs, (0, {"ddp": kept, "fsdp": kept}), str(tmp_path), {})
    last = capsys.readouterr().out.splitlines()[-1]
    assert code == 1 and last.startswith("LIKELY CAUSE: the checkpoint is written in place: the "
                                         "save made step0000003-"), last
    # the lab judges it before torchrun's launch when an earlier run's save already shows it
    assert {name for name, _ in prove.in_place_saves({"one": kept, "ddp": None})} == {"one"}
    code = prove.report({2}, {"one": kept}, None, str(tmp_path), {})
    out = capsys.readouterr().out
    assert code == 1 and "2. judged from the saves of the runs so far" in out
    assert out.splitlines()[-1].startswith("LIKELY CAUSE: the checkpoint is written in place")


# --- the lesson copied alone, and the command line ----------------------------------------------

@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """The folder copied alone (train_gpt.py, model.py, checkpoint.py), run under plain python."""
    run_once_per_session("test_11_train_gpt.alone")
    folder = tmp_path_factory.mktemp("alone")
    for name in ("train_gpt.py", "model.py", "checkpoint.py"):
        shutil.copy(FOLDER / name, folder / name)
    marker = uuid.uuid4().hex
    result = run_lesson(folder / "train_gpt.py", "--steps", 30, cwd=folder, timeout=120,
                        marker=marker)
    assert not kill_leftovers(marker), "the lesson left processes running"
    return result, folder


class TestTheLessonCopiedAlone:
    """The tests that read the one run of the folder copied alone: one class, one worker."""

    def test_it_trains_evaluates_saves_and_samples(self, alone):
        result, folder = alone
        assert result.returncode == 0, result.stderr[-3000:]
        assert "backend: gloo (no GPU visible); ddp on 1 rank(s)" in result.stdout
        line = last_line_matching(r"^validation loss ", result.stdout)
        assert "(the unigram entropy)" in line and "sample: " in result.stdout
        assert [p.name[:11] for p in sorted((folder / "out_gpt").glob("step*"))] == ["step0000030"]

    def test_a_second_run_resumes_and_has_nothing_left_to_do(self, alone):
        _, folder = alone
        again = subprocess.run([sys.executable, "train_gpt.py", "--steps", "30"], cwd=folder,
                               capture_output=True, text=True, timeout=60)
        assert again.returncode == 0, again.stderr[-2000:]
        assert "resuming from out_gpt/step0000030-" in again.stdout
        assert "validation loss" not in again.stdout, "no step left to train"


def test_the_profile_picture_draws_each_kind_of_work_from_the_traces(prove, tmp_path):
    """--scaling's picture, from two small traces of the profiler's format (no run here)."""
    names = {"forward": "DistributedDataParallel.forward", "backward": "autograd::engine::x",
             "all-reduce": "gloo:all_reduce", "optimizer": "Optimizer.step#AdamW.step"}
    for rank in (0, 1):
        events = [{"ph": "X", "name": name, "ts": 1000 * n + rank, "dur": 500}
                  for n, name in enumerate(names.values())]
        (tmp_path / f"trace-rank{rank}.json").write_text(json.dumps({"traceEvents": events}))
    assert set(prove.KINDS) == set(names)
    path = prove.draw_profile(str(tmp_path))
    assert path.endswith("profile.png") and os.path.getsize(path) > 1000


def test_help_names_every_flag_and_break(prove, capsys):
    shown = assert_help_in_process(prove.main, ["--break", "--lesson", "--claims", "--scaling",
                                                "--out-dir"], capsys)
    for name in prove.BREAKS:
        assert name in shown


@pytest.mark.parametrize("argv, message", [
    (["--lesson", "no_such_file.py"], "no such file"),
    (["--break", "no-purge", "--claims", "1"], "leave out --claims"),
    (["--scaling", "3"], "5 steps or more"),
])
def test_bad_input_is_refused_before_any_rank_starts(prove, capsys, argv, message):
    assert_refused_in_process(prove.main, argv, capsys, message)


def test_each_job_of_a_launch_gets_its_own_free_port():
    """The lab once used port, port + 1, ...: port + 1 was another process's (EADDRINUSE in CI)."""
    sys.path.insert(0, str(REPO))
    import course
    ports = course.find_free_ports(12)
    assert len(set(ports)) == 12 and all(0 < p < 65536 for p in ports)


# --- GPT-2 size, FLOPs and MFU (issue 33) -------------------------------------------------------

def test_flops_per_token_is_what_the_flop_counter_counts(lesson):
    """The formula MFU divides by (PaLM's 6N + 12 L d T) against FlopCounterMode's count of one
    forward and backward: the tiny model run for real, GPT-2 small on the meta device (no memory)."""
    from torch.utils.flop_counter import FlopCounterMode
    for size, device in [("tiny", "cpu"), ("gpt2-124m", "meta")]:
        _, context, _ = lesson.SIZES[size]
        with torch.device(device):
            model = lesson.make_model(context, 0.0, 0, size)
            x = torch.randint(0, 256, (2, context))
        with FlopCounterMode(display=False) as counter:
            model(x).float().sum().backward()
        counted = counter.get_total_flops() / x.numel()
        assert abs(counted / model.flops_per_token() - 1) < 0.02, (size, counted, model.flops_per_token())


def test_the_gpt2_preset_is_gpt2_small_with_124m_parameters(lesson):
    with torch.device("meta"):
        model = lesson.make_model(1024, 0.0, 0, "gpt2-124m")
    assert sum(p.numel() for p in model.parameters()) == 124_475_904  # nanoGPT's 124M, tied head
    assert (len(model.blocks), model.n_head, model.context, model.token.weight.shape) == \
        (12, 12, 1024, (50304, 768))
    assert lesson.make_model(64, 0.0, 0).flops_per_token() == 797_184  # the course's tiny GPT


def test_compile_runs_on_the_cpu_and_trains_as_eager_does(lesson, world_of_one, tmp_path):
    """--compile, 3 steps of the tiny model (a minute of compiling on 2 cores): the same losses as
    eager in this process (inductor's kernels sum in another order: close, not equal)."""
    result = run_lesson("11_train_gpt/train_gpt.py", "--compile", "--steps", "3", "--out-dir",
                        tmp_path / "compiled", timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "120,576 parameters, 0.000797 GFLOP per token" in result.stdout
    compiled = float(re.search(r"^step 3/3  loss (\S+)", result.stdout, re.M).group(1))
    _, losses, _ = lesson.main(steps=3, out_dir=str(tmp_path / "eager"))
    assert abs(compiled - losses[-1]) < 1e-3, (compiled, losses)
    assert "MFU" not in result.stdout  # no GPU: no peak to divide by


def test_tensorboards_train_loss_is_the_mean_over_the_ranks(prove, world_of_one, tmp_path):
    """Issue 32, item 8: 2 ranks of 16 windows log the loss of all 32 (one process on those 32
    windows, run here), not rank 0's alone (which the console prints, and says so)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    result = run_lesson("11_train_gpt/train_gpt.py", "--steps", "2", "--out-dir", tmp_path / "two",
                        launcher=torchrun, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rank0 = float(re.search(r"^step 2/2  loss (\S+) \(rank 0\)", result.stdout, re.M).group(1))
    events = EventAccumulator(str(tmp_path / "two" / "tensorboard"))
    events.Reload()
    logged = [e.value for e in events.Scalars("train/loss")]
    _, one, _ = prove.lesson.main(steps=2, batch_size=32, out_dir=str(tmp_path / "one"))
    assert len(logged) == 2 and max(abs(a - b) for a, b in zip(logged, one)) < 1e-5, (logged, one)
    assert abs(logged[1] - rank0) > 1e-3, (logged, rank0)  # the console's is rank 0's
