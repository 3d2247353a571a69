"""`benchmarks/kernels.py`: the count of kernels a training step launches, checked on operators whose
number is known, then on one tiny step of ours and of MarianMTModel."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is not an installed package
from benchmarks.kernels import count_kernels, main  # noqa: E402


def test_count_kernels_counts_each_kernel_once_and_no_views_metadata_or_allocations():
    a = torch.ones(4, 3)  # aten.ones

    def known():
        b = a.view(3, 4).t().detach()  # (4, 3); views: nothing
        c = b + 1  # aten.add
        d = c.to(torch.bfloat16)  # aten._to_copy, a cast
        e = torch.empty(4, 3)  # an allocation: nothing
        e.copy_(d)  # aten.copy_, a cast (bf16 into fp32)
        e.copy_(a)  # aten.copy_, not a cast
        f = e.to(torch.float32)  # the same dtype: no operator at all
        g = (f * 2).sum()  # aten.mul, aten.sum
        g.size(), g.dim(), e.is_contiguous()  # metadata, read without an operator
        return a.clone()  # aten.clone

    counts = count_kernels(known)
    assert dict(counts) == {"aten.add": 1, "aten._to_copy": 1, "aten.copy_": 2, "aten.mul": 1, "aten.sum": 1,
                            "aten.clone": 1}
    assert counts.total == 7 and counts.casts == 2


def test_count_kernels_sees_the_backward_pass():
    w = torch.ones(3, requires_grad=True)
    counts = count_kernels(lambda: (w * 2).sum().backward())
    assert counts["aten.mul"] == 2  # forward's, and backward's gradient times 2
    assert counts["aten.sum"] == 1


def test_quick_run_counts_ours_and_marian_and_their_casts(capsys):
    report = main(["--quick"])
    table = capsys.readouterr().out.splitlines()
    header = next(line for line in table if line.startswith("| |"))
    columns = [c.strip() for c in header.strip("|").split("|")][1:]
    assert columns == ["total", "matmul", "attention", "layer norm", "loss", "optimiser", "dropout", "casts", "other"]
    rows = {line.split("|")[1].strip(): line for line in table if line.startswith(("| ours", "| marian"))}
    assert set(rows) == {"ours", "marian"}
    for name, counts in report["counts"].items():
        cells = [int(c.replace(",", "")) for c in rows[name].strip("|").split("|")[1:]]
        assert cells[0] == counts.total == sum(counts.values())
        assert sum(cells[1:]) == counts.total  # every kernel in one category
        assert counts.casts > 0  # bf16 autocast casts weights and activations
        assert counts["aten.mm"] + counts["aten.addmm"] > 0
    assert report["shape"] == "tiny" and report["precision"] == "bf16"
