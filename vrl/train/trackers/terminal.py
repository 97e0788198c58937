"""The terminal: on a terminal a progress bar shows step, loss, tokens/s and ETA; otherwise (logs,
CI) a plain line per logged step; an evaluation is a line either way."""

from __future__ import annotations

import sys
from typing import Any

from vrl.train.trackers.tracker import Tracker


def prints_at(step: int, print_every: int, total_steps: int) -> bool:
    """Whether a training record of `step` is a line on the terminal: multiples of `print_every` (0:
    every record) and the last step."""
    return not print_every or step % print_every == 0 or step == total_steps


class TerminalTracker(Tracker):
    def __init__(self, total_steps: int, start_step: int, label: str, print_every: int = 0):
        """`label` starts every line (a run trained in a group: its folder's name); a training record is
        printed at steps that are multiples of `print_every` (0: every one) and at the last."""
        self.total_steps, self.label, self.print_every = total_steps, label, print_every
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps, initial=start_step, unit='step', dynamic_ncols=True, desc=label.strip() or None
            )

    def print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(self.label + line)
        else:
            print(self.label + line, flush=True)

    def log(self, step: int, record: dict[str, Any]) -> None:
        if 'eval_loss' in record:
            domains = ''.join(
                f'  {key[len("eval_loss/") :]} {value:.4f}'
                for key, value in record.items()
                if key.startswith('eval_loss/')
            )
            self.print(
                f'step {step}: eval_loss {record["eval_loss"]:.4f}  '
                f'eval_perplexity {record["eval_perplexity"]:.2f}  eval_bpb {record["eval_bpb"]:.4f}'
                + (f'  (per dataset:{domains})' if domains else '')
            )
            return
        if 'downstream_seconds' in record:
            scores = '  '.join(
                f'{key[len("downstream/") :].replace("/", " ")} {value:.4f}'
                for key, value in record.items()
                if key.startswith('downstream/')
            )
            self.print(f'step {step}: downstream  {scores}  ({record["downstream_seconds"]:.1f} s)')
            return
        epochs = {key[len('epoch/') :]: value for key, value in record.items() if key.startswith('epoch/')}
        short = (
            f'loss {record["loss"]:.4f}  lr {record["lr"]:.2e}  tok/s {record["tokens_per_sec"]:,.0f}  '
            f'mfu {record["mfu"]:.1%}'
            + (
                '  epoch '
                + ' '.join(
                    f'{value:.2f}' if len(epochs) == 1 else f'{name} {value:.2f}' for name, value in epochs.items()
                )
                if epochs
                else ''
            )
        )
        if self._bar is not None:
            self._bar.set_postfix_str(short, refresh=False)
            self._bar.update(step - self._bar.n)
        elif prints_at(step, self.print_every, self.total_steps):
            eta = (self.total_steps - step) * record['step_time']
            self.print(f'step {step}/{self.total_steps}  {short}  eta {eta / 60:.1f} min')

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
