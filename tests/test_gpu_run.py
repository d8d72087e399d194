"""`python run_lessons.py --gpu`: every lab on this machine's GPUs in one command, and a results
file. It ran once on one H200 (gpu_runs/); these tests check the plan against each lab's own guard rails with 1 to
16 GPUs pretended (in-process, nothing starts), the parsing of the labs' real output (the
READMEs' blocks), the refusal without a GPU, and the CPU rehearsal of the plan on one cheap lab."""
import json
import re
import subprocess
import sys

import pytest
import torch

import course
import run_lessons
from conftest import REPO, lesson_env, load_script

LABS = sorted(d.name for d in REPO.glob("[0-9][0-9]_*") if (d / "prove.py").exists())
COMMANDS = dict(run_lessons.lesson_commands())


def readme_output(lab):
    """The first output block of the lab's README: a real run of its main command."""
    found = re.search(r"<!--\s*output:.*?-->\s*```text\n(.*?)```", (REPO / lab / "README.md").read_text(),
                      re.S)
    return found.group(1)


def test_the_plan_has_a_line_for_every_lab():
    """A new lab folder without an entry in GPU_PLAN fails here (and --gpu would stop at it)."""
    assert set(run_lessons.GPU_PLAN) == set(LABS) == set(COMMANDS)
    with pytest.raises(KeyError, match="no entry in run_lessons.GPU_PLAN"):
        run_lessons.planned("12_new_lab", "python 12_new_lab/prove.py", 1)


def test_the_plan_asks_for_cuda_wherever_a_lab_has_the_flag():
    for lab in LABS:
        has_flag = "add_device_flag" in (REPO / lab / "prove.py").read_text()
        command, why = run_lessons.planned(lab, COMMANDS[lab], 8)
        assert command.startswith(COMMANDS[lab]) and why, lab
        assert ("--device cuda" in command) == has_flag, lab
        rehearsal, _ = run_lessons.planned(lab, COMMANDS[lab], 8, "cpu")
        assert rehearsal == command.replace("--device cuda", "--device cpu"), lab
    assert run_lessons.planned("02_ddp_spawn", COMMANDS["02_ddp_spawn"], 4)[0] == \
        "python 02_ddp_spawn/prove.py --device cuda --world-size 4"
    # Lab 04 passes its guard rails with 3+ ranks, but fails its claim there on any device: a
    # resumed DDP sums its first step in another order (its NOTES.md; the rehearsal showed it)
    assert run_lessons.planned("04_sampler_checkpoint", COMMANDS["04_sampler_checkpoint"], 8)[0] \
        .endswith("--world-size 2")


class Reached(Exception):
    """The lab got past every guard rail and was about to start its ranks (or train)."""


def reached(*args, **kwargs):
    raise Reached


@pytest.mark.parametrize("gpus", [1, 2, 3, 4, 5, 8, 16])
def test_each_lab_accepts_its_planned_flags_with_that_many_gpus(gpus, monkeypatch, capsys):
    """Each lab's main() with the planned flags and `gpus` GPUs pretended gets past its own guard
    rails (flags, --device cuda needing a GPU per rank, enough steps) to the point where it starts
    its ranks: a refusal (exit 2) would make the GPU run report a lab that never ran."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(course, "find_free_port", reached)  # every lab with ranks takes a port first
    monkeypatch.setattr(course, "find_free_ports", reached)  # (or several)
    for lab in LABS:
        argv = run_lessons.planned(lab, COMMANDS[lab], gpus)[0].split()[2:]
        if not argv:
            continue  # the lab's default command: the READMEs' tests run it
        prove = load_script(REPO / lab / "prove.py")
        monkeypatch.setattr(prove, "run_lesson", reached, raising=False)  # 01: trains in-process
        monkeypatch.setattr(prove, "compare_split_with_unsplit", reached, raising=False)  # 03: on cuda
        try:
            prove.main(argv)
        except Reached:
            pass
        except SystemExit as refused:
            pytest.fail(f"{lab} {' '.join(argv)} with {gpus} GPU(s): exit {refused.code}: "
                        f"{capsys.readouterr().err.strip()}")
        else:
            pytest.fail(f"{lab} {' '.join(argv)} returned without reaching its ranks")


EXAMPLES = {  # real PROOF lines (README output blocks): (measured, tolerance)
    "00_single_process": ("max |dw| at the start 0.0e+00, at the end 0.0e+00; mean loss epoch 0 "
                          "1.3312 -> epoch 1 1.0593", "0"),
    "01_dataparallel": ("16 of 16 steps seen; max |dy| 0.0e+00, max |dgrad| ~2.2e-08, final max |dw| "
                        "~6.0e-08", "1e-06"),  # the claim holds its own (2 replica threads)
    "02_ddp_spawn": ("max |dw| between ranks 0.0e+00, against one process ~3.0e-08", "1e-05"),
    "05_torchrun_elastic": ("torch.equal; max |dw| 0.0e+00", "0"),
    "11_train_gpt": ("float64 ~3.6e-14; gradient norms ~1.1e-15; resumed 0.0e+00; moved ~2.4e-16; "
                     "bf16 ~7.5e-03 to ~1.0e-02; FSDP x TP ~4.2e-14",
                     "1e-10 float64, 0 resumed, bf16 0.0001 to 0.05"),
}


def test_the_proof_line_gives_the_difference_and_the_tolerance():
    for lab, (measured, tolerance) in EXAMPLES.items():
        assert run_lessons.proof_of(readme_output(lab)) == (True, measured, tolerance), lab
    for lab in LABS:  # every lab's line parses, PASSED or FAILED
        output = readme_output(lab)
        passed, measured, tolerance = run_lessons.proof_of(output)
        assert passed and measured and tolerance, lab
        assert run_lessons.proof_of(output.replace("PROOF PASSED", "PROOF FAILED"))[0] is False, lab
    assert run_lessons.proof_of("no proof here\nRUN FAILED: a rank stopped\n") is None
    assert run_lessons.proof_of("PROOF PASSED: a (1, tolerance 2)\nPROOF FAILED: b (3, tolerance 4)\n") \
        == (False, "3", "4")  # the last one


def test_what_ran_is_read_from_the_labs_own_lines():
    """(backend, device, world size) from the READMEs' real outputs, and from the lines the same
    code prints on GPUs (the reason is course.backend_for's)."""
    expected = {"00_single_process": (None, "cpu", 2), "01_dataparallel": (None, "cpu", 2),
                "02_ddp_spawn": ("gloo", "cpu", 2), "03_model_parallel": ("gloo", "cpu", 2),
                "04_sampler_checkpoint": ("gloo", "cpu", 2), "05_torchrun_elastic": ("gloo", "cpu", 2),
                "06_collectives": ("gloo", "cpu", 2), "07_fsdp_dcp": ("gloo", "cpu", 2),
                "08_rpc": ("TensorPipe", "cpu", 2), "09_training_loop": ("gloo", "cpu", 2),
                "10_tensor_parallel": ("gloo", "cpu", 4),
                "11_train_gpt": (None, None, 2), "12_debugging": ("gloo", "cpu", 2),
                "13_pipeline_3d": ("gloo", "cpu", 4)}
    expected["14_fault_tolerance"] = ("gloo", "cpu", 3)  # 3 replica groups of one rank
    assert {lab: run_lessons.what_ran(readme_output(lab)) for lab in LABS} == expected
    assert run_lessons.what_ran("claim(s) 1, 2 of 7\n15 runs of main() on 1, 2, 3 and 4 ranks took 5 s\n") \
        == (None, None, [1, 2, 3, 4])  # lab 11's own line (the README leaves it out)
    assert run_lessons.what_ran("backend: nccl (1 GPU(s) visible, one per rank); world size 1; global "
                                "batch 1 x 16 = 16\n") == ("nccl", "cuda", 1)
    assert run_lessons.what_ran("device: cuda (a GPU is visible)\n") == (None, "cuda", None)
    assert run_lessons.what_ran("nn.DataParallel (2 GPUs: nn.DataParallel splits each batch over "
                                "cuda:0..1); 2 replica(s), threads of one process\n") == (None, "cuda", 2)
    assert run_lessons.what_ran(  # lab 03 on 2 GPUs without --device: each part says its own
        "split under DDP: gloo (2 GPU(s) for 4 ranks); 2 ranks x 2 devices\n"
        "pipeline: nccl (2 GPU(s) visible, one per rank); 2 ranks, one stage each\n") == \
        ("gloo+nccl", "cpu+cuda", 2)


def test_gpu_without_a_gpu_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for argv, message in [(["--gpu"], "--gpu needs a GPU and none is visible"),
                          (["--gpu", "--gpus", "0"], "--gpus 0: the plan is for 1 GPU or more"),
                          (["--gpu-plan-on-cpu", "--gpus", "-1"], "--gpus -1: the plan is for 1 GPU or more")]:
        monkeypatch.setattr(sys, "argv", ["run_lessons.py", *argv, "--only", "01"])
        assert run_lessons.main() == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"run_lessons.py: error: {message}") and len(err.splitlines()) == 1, err
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(sys, "argv", ["run_lessons.py", "--gpu", "--gpus", "3"])
    assert run_lessons.main() == 2 and "--gpus 3: 2 GPU(s) visible" in capsys.readouterr().err
    for argv in (["--gpus", "2"], ["--gpu", "--gpu-plan-on-cpu"]):  # argparse's usage and error
        monkeypatch.setattr(sys, "argv", ["run_lessons.py", *argv])
        with pytest.raises(SystemExit) as refused:
            run_lessons.main()
        assert refused.value.code == 2 and "error:" in capsys.readouterr().err


def test_gpu_list_prints_the_plan_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(sys, "argv", ["run_lessons.py", "--gpu", "--list", "--gpus", "2"])
    assert run_lessons.main() == 0
    out = capsys.readouterr().out
    assert "02_ddp_spawn: python 02_ddp_spawn/prove.py --device cuda --world-size 2\n" in out
    assert "08_rpc: python 08_rpc/prove.py\n    no GPU path" in out
    assert len(re.findall(r"^\d\d_\w+: python ", out, re.M)) == len(LABS)


def test_the_results_file_has_a_row_per_lab(monkeypatch, tmp_path, capsys):
    """The whole plan for 2 GPUs, each lab answering with its README's output (nothing starts);
    one lab fails: its row keeps its last lines, and the run exits 1."""
    def fake_run(argv, limit):
        lab = argv[1].split("/")[0]
        return (1, "Traceback ...\nRuntimeError: NCCL error\n") if lab == "06_collectives" else \
            (0, readme_output(lab))
    monkeypatch.setattr(run_lessons, "run_and_show", fake_run)
    results = tmp_path / "results.json"
    assert run_lessons.run_gpu_plan(list(COMMANDS.items()), 2, "cuda", results) == 1
    saved = json.loads(results.read_text())
    assert saved["hardware"] == course.hardware() and saved["plan_for_gpus"] == 2
    assert saved["run_on"] == "cuda" and "cuda" in saved and "gpus_visible" in saved
    rows = {row["lab"]: row for row in saved["labs"]}
    assert list(rows) == LABS
    assert rows["02_ddp_spawn"] == {
        "lab": "02_ddp_spawn", "backend": "gloo", "device": "cpu", "world_size": 2,
        "difference": "max |dw| between ranks 0.0e+00, against one process ~3.0e-08",
        "tolerance": "1e-05", "proof": "PASSED", "seconds": rows["02_ddp_spawn"]["seconds"], "exit": 0,
        "command": "python 02_ddp_spawn/prove.py --device cuda --world-size 2",
        "plan": run_lessons.GPU_PLAN["02_ddp_spawn"][1]}
    failed = rows["06_collectives"]
    assert (failed["exit"], failed["proof"], failed["backend"], failed["difference"]) == (1, None, None, None)
    assert failed["last_lines"] == ["Traceback ...", "RuntimeError: NCCL error"]
    assert "last_lines" not in rows["02_ddp_spawn"]
    summary = capsys.readouterr().out
    assert re.search(r"^06_collectives +1 +- +- +- ", summary, re.M)
    assert f"results: {results}" in summary


@pytest.mark.timeout(120)
def test_the_gpu_plan_rehearsed_on_the_cpu_writes_the_results_file(lesson, tmp_path):
    """The one command, end to end, on the CPU: lab 01 as the 2-GPU plan runs it, cpu for cuda."""
    results = tmp_path / "results.json"
    result = subprocess.run([sys.executable, "run_lessons.py", "--gpu-plan-on-cpu", "--gpus", "2",
                             "--only", "01", "--results", str(results)], cwd=REPO, capture_output=True,
                            text=True, timeout=110, env=lesson_env(lesson.tag))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "PROOF PASSED" in result.stdout  # the lab's own output, shown as it ran
    saved = json.loads(results.read_text())
    assert "cores" in saved["hardware"] and "torch" in saved["hardware"]
    assert saved["plan_for_gpus"] == 2 and saved["run_on"].startswith("cpu: a rehearsal")
    [row] = saved["labs"]
    assert row["lab"] == "01_dataparallel"
    assert row["command"] == "python 01_dataparallel/prove.py --device cpu --replicas 2"
    assert (row["exit"], row["proof"], row["backend"], row["device"], row["world_size"]) == \
        (0, "PASSED", None, "cpu", 2)
    assert "final max |dw|" in row["difference"] and row["tolerance"] == "1e-06"
    assert 0 < row["seconds"] < 110


def test_the_capstones_numbers_are_read_from_its_lines():
    """What --gpu keeps of the capstone's runs: its model line and its LAST report (the first one's
    rate includes compiling); MFU only where the line has one (a GPU in PEAK_TFLOPS)."""
    output = ("backend: nccl (1 GPU(s) visible, one per rank); ddp on 1 rank(s); ...; "
              "124,475,904 parameters, 0.855 GFLOP per token; resuming from None\n"
              "step 100/200  loss 3.1 (rank 0)  val 3.2 (99 tokens)  lr 6.0e-04  9,000 tokens/s per "
              "rank (MFU 0.8%)  11 s left; saved x\n"
              "step 200/200  loss 2.9 (rank 0)  val 3.0 (99 tokens)  lr 6.0e-05  412,345 tokens/s "
              "per rank (MFU 35.6%)  0 s left; saved y\n")
    assert run_lessons.capstone_numbers(output) == {
        "parameters": 124_475_904, "gflop_per_token": 0.855, "last_report_step": 200,
        "tokens_per_s_per_rank": 412_345, "mfu": 0.356}
    on_cpu = output.replace(" (MFU 35.6%)", "").replace(" (MFU 0.8%)", "")
    assert run_lessons.capstone_numbers(on_cpu)["mfu"] is None
    assert run_lessons.capstone_numbers("Traceback ...\n") == dict.fromkeys(
        ["parameters", "gflop_per_token", "last_report_step", "tokens_per_s_per_rank", "mfu"])
