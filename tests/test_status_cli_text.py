"""`packrat status`'s line: the live plan's prediction names the input shape it is for (issue 32 item 3)."""

from __future__ import annotations

from packrat.commands.tune import predicted_text, traffic_text


def test_prediction_names_its_input_shape() -> None:
    assert predicted_text(65.61, {"tokens": 5}) == "predicted 65.6 ms for tokens 5"
    assert predicted_text(12.0, {"pixels": 50176, "tokens": 8}) == "predicted 12.0 ms for pixels 50176, tokens 8"
    # A plan made before sizes were recorded says so rather than implying one.
    assert predicted_text(3.25, None) == "predicted 3.2 ms (input shape not recorded)"
    assert predicted_text(None, {"tokens": 5}) == ""


def test_traffic_text() -> None:
    assert traffic_text({"tokens": {"requests": 9, "mean": 7.1, "p50": 6, "p90": 115}}) == "tokens p50 6 p90 115"
    assert traffic_text(None) == "" and traffic_text({}) == ""
