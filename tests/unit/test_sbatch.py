"""The sbatch templates, run in dry-run mode: their variables are checked by megatron_bfpp's own
checks before anything starts, extra arguments reach pretrain_gpt.py verbatim, and each shipped
configuration fits the GPUs it is sized for."""

from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

SLURM = Path(__file__).resolve().parents[2] / "scripts" / "slurm"
TEMPLATES = ("pretrain_gpt3.sbatch", "pretrain_llama.sbatch")


def _dry_run(
    template: str, *args: str, cwd: Path | None = None, **variables: str
) -> subprocess.CompletedProcess[str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("SLURM_") and key not in ("MEGATRON_LM", "SCHEDULE_ARGS")
    }
    env.update(DRY_RUN="1", PYTHON=sys.executable, **variables)
    return subprocess.run(
        ["bash", str(SLURM / template), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        check=False,
    )


def _number(pattern: str, text: str) -> int:
    match = re.search(pattern, text, re.M)
    assert match, f"no {pattern!r}"
    return int(match.group(1))


def _directive(template: str, name: str) -> int:
    return _number(rf"^#SBATCH --{name}=(\d+)$", (SLURM / template).read_text())


def _megatron_args(line: str) -> list[str]:
    words = shlex.split(line)
    return words[next(i for i, w in enumerate(words) if w.endswith("/pretrain_gpt.py")) + 1 :]


@pytest.mark.parametrize("template", TEMPLATES)
def test_dry_run_prints_one_command_per_node(template: str) -> None:
    result = _dry_run(
        template, PIPELINE_SCHEDULE="1f1b", VP="1", MEGATRON_LM_PATH="/opt/Megatron LM"
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == _directive(template, "nodes")
    for line in lines:
        assert f" {shlex.quote(sys.executable)} -m torch.distributed.run " in line  # $PYTHON
        assert "/opt/Megatron LM/pretrain_gpt.py" in shlex.split(line)
        assert "--pipeline-schedule 1f1b" in line
        assert f" --nproc-per-node={_directive(template, 'gpus-per-node')} " in line
    assert "--num-virtual-stages-per-pipeline-rank" not in result.stdout


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize(
    ("variables", "args", "message"),
    [
        (
            {"PIPELINE_SCHEDULE": "zigzag"},
            (),
            "launch.py: error: argument --pipeline-schedule: invalid choice: 'zigzag'",
        ),
        ({"PP": "7"}, (), "launch.py: error: world size "),
        ({"PP": "16", "VP": "4"}, (), "layers per pipeline rank do not split into 4 virtual"),
        (
            {"VP": "abc"},
            (),
            "launch.py: error: argument --num-virtual-stages-per-pipeline-rank: expected a "
            "positive integer, got 'abc'",
        ),
        (
            {"PIPELINE_SCHEDULE": "interleaved", "GLOBAL_BATCH": "100"},
            (),
            "--pipeline-schedule interleaved cannot run 50 micro",
        ),
        (
            {},
            ("--bpipe-max-stored", "3"),
            "launch.py: error: --bpipe-max-stored applies to --pipeline-schedule bpipe",
        ),
        (
            {"PIPELINE_SCHEDULE": "bpipe", "VP": "1", "RANK_PLACEMENT": "pair-adjacent", "TP": "8"},
            (),
            "launch.py: error: --rank-placement pair-adjacent: a node must hold whole",
        ),
        ({"SCHEDULE_ARGS": "*"}, (), "SCHEDULE_ARGS is no longer read; pass extra arguments"),
        ({"MEGATRON_LM": "/opt/m"}, (), "MEGATRON_LM is now MEGATRON_LM_PATH; set that instead"),
    ],
    ids=[
        "unknown-schedule",
        "pp-7",
        "layers-over-vp",
        "vp-abc",
        "micro-batches",
        "option-of-another-schedule",
        "pair-adjacent-tp-8",
        "old-schedule-args",
        "old-megatron-lm",
    ],
)
def test_bad_values_stop_with_one_line(
    template: str, variables: dict[str, str], args: tuple[str, ...], message: str
) -> None:
    result = _dry_run(template, *args, **variables)
    assert result.returncode != 0
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert message in result.stderr


@pytest.mark.parametrize("template", TEMPLATES)
def test_extra_arguments_are_neither_split_nor_globbed(template: str, tmp_path: Path) -> None:
    (tmp_path / "a.txt").touch()
    extra = ("--tensorboard-dir", "*", "--wandb-exp-name", "two words")
    result = _dry_run(template, *extra, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for line in result.stdout.splitlines():
        assert _megatron_args(line)[-4:] == list(extra)
    assert "a.txt" not in result.stdout


# Megatron-LM pads the vocabulary to a multiple of this (--make-vocab-size-divisible-by) x tp.
VOCAB_DIVISOR = 128
# Weights, gradients and optimizer state may take this share of a GPU's memory; the rest is
# left for activations, communication buffers, the CUDA context and fragmentation.
STATIC_SHARE = 0.6


def _flags(args: list[str]) -> dict[str, str]:
    flags: dict[str, str] = {}
    for i, word in enumerate(args):
        if word.startswith("--"):
            following = args[i + 1] if i + 1 < len(args) else "--"
            flags[word] = "" if following.startswith("--") else following
    return flags


def _layer_parameters(f: dict[str, str]) -> int:
    h, heads = int(f["--hidden-size"]), int(f["--num-attention-heads"])
    kv = h // heads * int(f["--num-query-groups"]) if "--group-query-attention" in f else h
    ffn = int(f.get("--ffn-hidden-size", 4 * h))
    attention = h * (h + 2 * kv) + h * h
    mlp = (2 if "--swiglu" in f else 1) * h * ffn + ffn * h
    biases = 0 if "--disable-bias-linear" in f else (h + 2 * kv) + h + ffn + h
    norms = 2 * (h if f.get("--normalization") == "RMSNorm" else 2 * h)
    return attention + mlp + biases + norms


def _parameters(f: dict[str, str], *, vocab: int) -> tuple[int, float]:
    """(whole model, one GPU of the heavier of the first and last pipeline stages)."""
    tp, pp = int(f["--tensor-model-parallel-size"]), int(f["--pipeline-model-parallel-size"])
    h, layers, seq = int(f["--hidden-size"]), int(f["--num-layers"]), int(f["--seq-length"])
    embedding = math.ceil(vocab / (VOCAB_DIVISOR * tp)) * VOCAB_DIVISOR * tp * h
    learned = f.get("--position-embedding-type", "learned_absolute") == "learned_absolute"
    positions = seq * h if learned else 0
    final_norm = h if f.get("--normalization") == "RMSNorm" else 2 * h
    untied = "--untie-embeddings-and-output-weights" in f
    total = layers * _layer_parameters(f) + embedding * (2 if untied else 1) + positions
    stage = layers // pp * _layer_parameters(f) + embedding
    return total + final_norm, (stage + max(positions, final_norm)) / tp


def _bytes_per_parameter(f: dict[str, str], *, dp: int) -> float:
    assert "--bf16" in f
    sharded_over = dp if "--use-distributed-optimizer" in f else 1
    return 2 + 4 + (4 + 8) / sharded_over


@pytest.mark.parametrize("template", TEMPLATES)
def test_weights_gradients_and_optimizer_fit_the_gpus(template: str) -> None:
    """Per-GPU bytes of the template's default configuration against the GPU memory it states.

    Parameters: one formula for both templates, read from the dry run's own pretrain_gpt.py
    arguments. Per layer: attention h(h + 2k) + h^2 (k = h/a x query groups with grouped-query
    attention, else h), MLP (2 if SwiGLU else 1) h f + f h (f = --ffn-hidden-size, default 4h),
    biases unless --disable-bias-linear, two norms (2h LayerNorm, h RMSNorm). For GPT-3 that is
    12h^2 + 13h, the standard formula (Narayanan et al. 2021: 12 L h^2 + 13 L h + (V + s) h).
    The vocabulary V (the template's stated tokenizer) is padded as Megatron pads it, to a
    multiple of 128 x tp. A GPU of the first (last) pipeline stage holds L/pp layers, the input
    (output) embedding V h and with learned positions s h (the final norm): everything divided
    by tp (norms and row-parallel biases are in fact replicated; < 0.01% here).

    Bytes per parameter on a GPU: 2 (bf16 weights) + 4 (fp32 main gradients) + (4 fp32 master
    weights + 8 Adam moments) / dp, the distributed optimizer sharding the last 12 over the dp
    data-parallel ranks (/ 1 without --use-distributed-optimizer). They must stay within 60% of
    the stated GPU memory (GB = 10^9 bytes), leaving 40% for activations and the rest.
    """
    text = (SLURM / template).read_text()
    gpu_gb = _number(r"^# Sized for GPUs with (\d+) GB each", text)
    vocab = _number(r"vocabulary of (\d+) tokens", text)
    billions = _number(r"^# .*?(\d+)B\b", text)  # the model's size, from its first line

    result = _dry_run(template)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    f = _flags(_megatron_args(lines[0]))
    world = len(lines) * _number(r"--nproc-per-node=(\d+)", lines[0])
    tp, pp = int(f["--tensor-model-parallel-size"]), int(f["--pipeline-model-parallel-size"])
    dp = world // (tp * pp * int(f.get("--context-parallel-size", 1)))

    total, per_gpu = _parameters(f, vocab=vocab)
    assert abs(total / 1e9 - billions) / billions < 0.02, f"{total / 1e9:.1f}B, not {billions}B"
    static = per_gpu * _bytes_per_parameter(f, dp=dp)
    assert static <= STATIC_SHARE * gpu_gb * 1e9, (
        f"{template}: {static / 1e9:.1f} GB of weights, gradients and optimizer state per GPU "
        f"(tp={tp}, pp={pp}, dp={dp}) leave less than {1 - STATIC_SHARE:.0%} of {gpu_gb} GB"
    )


@pytest.mark.parametrize("template", TEMPLATES)
def test_breadth_first_activations_fit_beside_the_weights(template: str) -> None:
    """The default schedule is breadth-first, which stores every micro-batch of a chunk between
    its forwards and its backwards: m = global batch / (dp x micro batch) micro-batches through
    a full stage of L/pp layers at the peak (``bfpp-sim`` reports it as ``peak act.`` = m).
    Activations per layer and micro-batch with sequence parallelism: 34 s b h / t bytes
    (Korthikanti et al. 2022, without the attention-score term that flash attention avoids), an
    estimate. Weights, gradients and optimizer state plus these must fit the stated GPU memory
    with 10% to spare."""
    text = (SLURM / template).read_text()
    gpu_gb = _number(r"^# Sized for GPUs with (\d+) GB each", text)
    vocab = _number(r"vocabulary of (\d+) tokens", text)
    result = _dry_run(template)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    f = _flags(_megatron_args(lines[0]))
    assert f["--pipeline-schedule"] == "breadth-first"
    assert "--sequence-parallel" in f
    world = len(lines) * _number(r"--nproc-per-node=(\d+)", lines[0])
    tp, pp = int(f["--tensor-model-parallel-size"]), int(f["--pipeline-model-parallel-size"])
    dp = world // (tp * pp)
    micro, seq, h = int(f["--micro-batch-size"]), int(f["--seq-length"]), int(f["--hidden-size"])
    microbatches = int(f["--global-batch-size"]) // (dp * micro)
    layers = int(f["--num-layers"]) // pp
    activations = microbatches * layers * 34 * seq * micro * h / tp
    _, per_gpu = _parameters(f, vocab=vocab)
    static = per_gpu * _bytes_per_parameter(f, dp=dp)
    assert static + activations <= 0.9 * gpu_gb * 1e9, (
        f"{template}: {static / 1e9:.1f} GB static + {activations / 1e9:.1f} GB of activations "
        f"({microbatches} micro-batches x {layers} layers) exceed 90% of {gpu_gb} GB"
    )


@pytest.mark.parametrize("template", TEMPLATES)
def test_a_spooled_copy_finds_the_checkout_it_was_submitted_from(
    template: str, tmp_path: Path
) -> None:
    """sbatch runs a copy of the script from its spool directory, where ../.. is no checkout."""
    spooled = tmp_path / "spool" / "slurm_script"
    spooled.parent.mkdir()
    spooled.write_text((SLURM / template).read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(DRY_RUN="1", PYTHON=sys.executable, SLURM_SUBMIT_DIR=str(SLURM.parent.parent))
    env.pop("REPO", None)
    result = subprocess.run(
        ["bash", str(spooled)], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "--pipeline-schedule breadth-first" in result.stdout


def test_a_spooled_copy_without_its_checkout_says_so_in_one_line(tmp_path: Path) -> None:
    spooled = tmp_path / "slurm_script"
    spooled.write_text((SLURM / "pretrain_gpt3.sbatch").read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "REPO"}
    env.update(DRY_RUN="1", PYTHON=sys.executable)
    result = subprocess.run(
        ["bash", str(spooled)], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "no megatron_bfpp checkout at" in result.stderr and "set REPO=" in result.stderr


@pytest.mark.parametrize("template", TEMPLATES)
def test_auto_is_decided_quietly_before_the_job_and_refused_in_one_line(template: str) -> None:
    """PIPELINE_SCHEDULE=auto: the pre-flight runs auto's decision without CUDA (memory is no
    constraint there: the GPUs decide again, with their memory), prints only the commands, and
    refuses in one line what cannot fit the GPU it is told of."""
    result = _dry_run(template, PIPELINE_SCHEDULE="auto", VP="1")
    assert result.returncode == 0, result.stderr
    assert "--pipeline-schedule auto" in result.stdout and "auto:" not in result.stdout
    refused = _dry_run(
        template, "--pipeline-schedule-auto-gpu", "v100-32gb", PIPELINE_SCHEDULE="auto", VP="1"
    )
    assert refused.returncode != 0
    assert refused.stderr.count("\n") == 1 and "nothing fits v100-32gb" in refused.stderr


@pytest.mark.parametrize("template", TEMPLATES)
def test_dry_run_in_a_job_without_scontrol_is_one_line(template: str, tmp_path: Path) -> None:
    """DRY_RUN=1 inside an allocation (``SLURM_JOB_NODELIST=node[01-02]``) on a machine whose
    ``scontrol`` is missing: the launcher's one line, not a FileNotFoundError traceback."""
    path = [d for d in os.environ["PATH"].split(os.pathsep) if not Path(d, "scontrol").exists()]
    result = _dry_run(
        template,
        PIPELINE_SCHEDULE="1f1b",
        VP="1",
        SLURM_JOB_NODELIST="node[01-02]",
        PATH=os.pathsep.join(path),
    )
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == (
        "launch.py: error: cannot expand SLURM_JOB_NODELIST=node[01-02]: scontrol: No such file "
        "or directory; run inside a SLURM job, or name the hosts with --nodes host1,host2\n"
    )
