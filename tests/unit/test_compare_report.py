"""The compare report's token columns (issue 25, item 8)."""

from __future__ import annotations

import re

from polytrain.compare.report import BackendResult, format_table


def test_compare_table_adds_tokens_and_grad_norm_only_for_token_runs():
    digits = BackendResult("ddp", losses=[1.0], samples_per_s=[10.0])
    assert "tokens/s" not in format_table([digits])
    lm = BackendResult(
        "fsdp", losses=[3.0, 2.0], samples_per_s=[5.0, 6.0], tokens_per_s=[80.0, 96.0],
        grad_norms=[1.5, 0.7],
    )  # fmt: skip
    header = format_table([digits, lm]).splitlines()[0]
    assert re.search(r"samples/s\s+tokens/s\s+grad norm\s+final loss", header), header
    row = lm.row()
    assert (row["tokens_per_s"], row["grad_norm"]) == (96.0, 0.7)
    assert digits.row()["tokens_per_s"] == ""
