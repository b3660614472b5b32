"""A scripted user for the multi-turn end-to-end test: it answers the assistant's first two turns with
"again" and ends the trajectory at the third. Each instance (one trajectory) appends a line per call
to <$SCRIPTED_USER_LOG>/rank<RANK>.<pid>.log, so the tests can count where environments ran."""

import os
from typing import Any

from agent import StepResult


class AskAgain:
    def reset(self, prompt_row: Any) -> None:
        self.turns = 0
        self._log("reset")

    def step(self, assistant_text: str) -> StepResult:
        self.turns += 1
        self._log(f"step {self.turns}")
        if self.turns > 2:
            return StepResult(None)
        return StepResult([{"role": "user", "content": "again"}])

    def close(self) -> dict[str, float]:
        return {"asked": float(min(self.turns, 2))}

    def _log(self, what: str) -> None:
        with open(os.path.join(os.environ["SCRIPTED_USER_LOG"], f"rank{os.environ.get('RANK', 0)}.{os.getpid()}.log"), "a") as f:
            f.write(f"{id(self)} {what}\n")
