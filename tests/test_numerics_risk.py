"""Risky layers are judged on the figures as the tables show them."""

import re

import pytest

from transformer_linear.numerics.report import CompareReport, LayerStats
from transformer_linear.numerics.risk import RiskThresholds


def _row(output=28.0, dgrad=25.0, wgrad=24.0, saturation=0.0, underflow=0.0):
    return LayerStats("fc", "R", output, 0.1, dgrad, 0.1, wgrad, 0.1, input={"saturation": saturation, "underflow": underflow})


@pytest.mark.parametrize("row, reasons", [
    (_row(wgrad=9.96), []),  # shows as 10.0: not below 10
    (_row(wgrad=9.94), ["dW SQNR 9.9 dB < 10"]),
    (_row(output=19.96), []),
    (_row(output=19.94), ["output SQNR 19.9 dB < 20"]),
    (_row(saturation=0.010049), []),  # shows as 1.00%: not above 1%
    (_row(saturation=0.01006), ["x saturation 1.01% > 1%"]),
    (_row(underflow=0.0100004), []),  # shows as 1.000%
    (_row(underflow=0.010006), ["x underflow 1.001% > 1%"]),
])
def test_a_reason_never_contradicts_the_table(row, reasons):
    assert RiskThresholds().reasons(row) == reasons
    table = CompareReport(["R"], [row], 1.0, {"R": 1.0}).table()
    for reason in reasons:  # the value the reason quotes is the one the table shows
        assert f" {re.search(r'[0-9.]+(?=%? )', reason).group()} " in f" {table} ".replace("\n", " ")
