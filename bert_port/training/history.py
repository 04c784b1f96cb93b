"""A run's history as plain data: the steps, the evaluations, the best so far and the count
towards early stopping. The recipe keeps it, `resume` saves it whole, metrics.json shows it;
these functions change it and read nothing else, so the bookkeeping is tested without a run."""

from __future__ import annotations

from typing import Any


def new_history(patience: int | None) -> dict[str, Any]:
    """The history of a run that has not taken a step."""
    return {
        "steps": [],  # one record per optimiser step
        "evaluations": [],
        "best": None,
        "early_stopping": {
            "patience": patience,
            "evaluations_without_improvement": 0,
            "stopped_early": False,
            "stopped_at_step": None,
        },
        "train_time_s": 0.0,
        "examples": 0,
    }


def record_evaluation(history: dict[str, Any], result: dict[str, Any], step: int, steps_per_epoch: int) -> dict:
    """Append the evaluation `result` at optimiser `step` to `history`, with the mean training
    loss since the previous one; the confusion matrix is kept for the best evaluation only."""
    epoch, rest = divmod(step, steps_per_epoch)
    previous = history["evaluations"][-1]["step"] if history["evaluations"] else 0
    losses = [s["loss"] for s in history["steps"] if s["step"] > previous]
    record = {
        "epoch": epoch + (rest > 0),
        "step": step,
        "train_loss": sum(losses) / len(losses) if losses else None,
        "validation": {k: v for k, v in result.items() if k != "confusion"},
    }
    history["evaluations"].append(record)
    return record


def update_best(history: dict[str, Any], result: dict[str, Any], record: dict[str, Any], metric: str) -> bool:
    """Whether `result` beats the best so far by `metric` (lower for the loss, higher for any
    other); if so it becomes the best, else it counts towards early stopping, which is marked
    stopped once the count reaches the patience."""
    best, stopping = history["best"], history["early_stopping"]
    value = result[metric]
    if best is not None and not (value < best["value"] if metric == "loss" else value > best["value"]):
        stopping["evaluations_without_improvement"] += 1
        patience = stopping["patience"]
        if patience is not None and stopping["evaluations_without_improvement"] >= patience:
            stopping.update(stopped_early=True, stopped_at_step=record["step"])
        return False
    stopping["evaluations_without_improvement"] = 0
    history["best"] = {"epoch": record["epoch"], "step": record["step"], "metric": metric, "value": value}
    if "confusion" in result:
        history["best"]["confusion"] = result["confusion"]
    return True
