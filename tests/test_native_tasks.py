"""The C kernels' work sharing (csrc/tasks.h): each thread starts on its own rows and steals the
rest, so every task runs once whatever the team OpenMP actually gives. Checked where threads are
absent: under OMP_THREAD_LIMIT=1 a call asks for 3 threads and gets 1, which must take all three
ranges (a kernel that ran only its own range would leave two thirds of the output unwritten)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from bert_port.speed import kernels

SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from bert_port.speed import attention, kernels
    from bert_port.speed.gemm import RowStableLinear
    from bert_port.packing import pack

    torch.manual_seed(0)
    lengths = [5, 40, 17, 60, 3, 33, 9, 28]
    mask = (torch.arange(60)[None] < torch.tensor(lengths)[:, None]).long()
    packing = pack(mask)
    qkv = torch.randn(packing.num_tokens, 3 * 64).bfloat16()
    layer = RowStableLinear.swap(torch.nn.Linear(384, 1536), batch_invariant=True).bfloat16()
    layer.activation = F.gelu
    x = torch.randn(300, 384).bfloat16()
    outputs = {}
    for threads in (1, 3):
        torch.set_num_threads(threads)
        with torch.inference_mode():
            outputs[threads] = (attention.packed_attention(qkv, packing, 2, 0.2), layer(x))
    assert torch.get_num_threads() == 3
    assert torch.equal(outputs[1][0], outputs[3][0]), "a range of the attention was not taken"
    # (oneDNN, where the AMX kernel does not run, may give other bits at another thread count)
    assert not kernels.amx_ready() or torch.equal(outputs[1][1], outputs[3][1]), "a range of the GEMM was not taken"
    print("amx", kernels.amx_ready())
    """
)


@pytest.mark.skipif(not kernels.available(), reason="the C kernels are not installed: the PyTorch path only")
def test_every_range_runs_when_the_team_is_smaller_than_asked():
    if not torch._C.has_openmp:
        pytest.skip("torch without OpenMP: the kernels run on one thread")
    env = {**os.environ, "OMP_THREAD_LIMIT": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"amx {kernels.amx_ready()}" in done.stdout  # the AMX kernel ran there where it runs here
