"""A clock for tests of code that waits (kai_fractions.clock's Clock and AsyncClock): it records
each wait and runs time forward instead of sleeping."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FakeClock:
    now: float = 0.0
    sleeps: list[float] = field(default_factory=list)

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)
