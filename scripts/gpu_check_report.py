"""gpu_check.md: the figures of scripts/gpu_check.py's JSON report, as short Markdown tables."""

from __future__ import annotations


def _number(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e-2 or abs(value) >= 1e4 else f"{value:.{digits}f}"
    return str(value)


def _steps(report: dict) -> list[str]:
    lines = ["| step | status | seconds | note |", "|---|---|---|---|"]
    for name, step in report["steps"].items():
        note = step.get("error") or step.get("reason") or ""
        lines.append(f"| {name} | {step['status']} | {step['seconds']:.1f} | {note[:160]} |")
    return lines


def _correctness(results: dict) -> list[str]:
    lines = ["", "Correctness (relative error against float64 on the CPU; STARE weights: entries that differ):", "",
             "| dtype | STARE weights differing | loss | gradient | fused vs plain log-probs | fused vs plain entropy "
             "| fused vs float64 log-probs | passed |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for dtype in ("float32", "bfloat16"):
        if dtype not in results:
            continue
        loss, head = results[dtype]["stare_and_loss"], results[dtype]["lm_head"]
        lines.append(
            f"| {dtype} | {loss['stare_weights_differing']} | {_number(loss['loss_relative_error'])} "
            f"| {_number(loss['grad_relative_error'])} | {_number(head['fused_vs_plain_logprobs'])} "
            f"| {_number(head['fused_vs_plain_entropy'])} | {_number(head['fused_vs_float64_logprobs'])} "
            f"| {results[dtype]['passed']} |"
        )
    telemetry = results.get("telemetry", {})
    lines.append(f"\nTelemetry on the device vs the CPU: {telemetry.get('metrics_compared')} values, largest "
                 f"difference {_number(telemetry.get('max_abs_difference'))}.")  # fmt: skip
    return lines


def _by_step(results: dict, key: str) -> str:
    return ", ".join(_number(value) for value in results.get(key, [])) or "-"


def _fits(report: dict) -> list[str]:
    columns = ["fit", "steps logged", "wall s", "loss by step", "reward std by step", "step s", "peak GiB",
               "skipped (non-finite)", "loss scale", "KL by step"]  # fmt: skip
    lines = ["", f"| {' | '.join(columns)} |", "|" + "---|" * len(columns)]
    for name, step in report["steps"].items():
        results = step.get("results") or {}
        if "steps_logged" not in results:
            continue
        last = results["last"]
        lines.append(
            f"| {name} | {results['steps_logged']} | {results['wall_s']:.0f} | {_by_step(results, 'loss_by_step')} "
            f"| {_by_step(results, 'reward_std_by_step')} | {_number(last.get('step_s'))} "
            f"| {_number(last.get('peak_gib'))} "
            f"| {_number(last.get('nonfinite_skipped'))} | {_number(last.get('loss_scale'))} "
            f"| {_by_step(results, 'kl_by_step')} |"
        )
    return lines


def _performance(results: dict) -> list[str]:
    lines = ["", f"Performance: {results['model']}, {results['parameters'] / 1e9:.2f} B parameters, bf16 peak "
             f"{_number(results['peak_bf16_tflops'])} TFLOP/s.", "",
             "| response tokens | fused head | grad. checkpointing | tokens/s | MFU | peak GiB | step growth GiB |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in results["updates"]:
        if "error" in row:
            lines.append(f"| {row['response_tokens']} | {row['fused_lm_head']} | {row['gradient_checkpointing']} "
                         f"| {row['error'][:60]} | | | |")  # fmt: skip
            continue
        lines.append(
            f"| {row['response_tokens']} | {row['fused_lm_head']} | {row['gradient_checkpointing']} "
            f"| {row['tokens_per_s']:.0f} | {_number(row['mfu'])} | {_number(row.get('peak_gib'))} "
            f"| {_number(row.get('peak_growth_gib'))} |"
        )
    generation = results["generation"]
    rows, new_tokens, speed = generation["rows"], generation["new_tokens_per_row"], generation["tokens_per_s"]
    lines.append(f"\n{generation['engine']}: {rows} rows x {new_tokens} new tokens, {speed:.0f} tokens/s.")
    return lines


def write_markdown(report: dict) -> str:
    environment = report["steps"].get("environment", {}).get("results") or {}
    title = "GPU check (CPU dry run)" if report["dry_run"] else "GPU check"
    lines = [f"# {title}", "", f"{environment.get('device', '?')}; torch {environment.get('torch', '?')}, CUDA "
             f"{environment.get('cuda')}; started {report['started']}.", "", *_steps(report)]  # fmt: skip
    correctness = report["steps"].get("correctness", {}).get("results")
    if correctness:
        lines += _correctness(correctness)
    lines += _fits(report)
    performance = report["steps"].get("performance", {}).get("results")
    if performance:
        lines += _performance(performance)
    return "\n".join(lines) + "\n"
