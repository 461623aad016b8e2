"""The model lock (trainer/standby.py): one holder per model and stack home, a standby takes over when it is free."""

from __future__ import annotations

import asyncio
import os

from agentstream.trainer.standby import ModelLock


def test_a_second_trainer_of_the_model_stands_by_until_the_first_lets_go(tmp_path) -> None:
    lines: list[str] = []

    async def scenario() -> None:
        active, standby, other_model = (ModelLock(tmp_path, "m"), ModelLock(tmp_path, "m"),
                                        ModelLock(tmp_path, "other/model"))
        assert await active.take(asyncio.Event(), lines.append) and active.held
        assert await other_model.take(asyncio.Event(), lines.append)  # another model: no wait
        waiting = asyncio.create_task(standby.take(asyncio.Event(), lines.append))
        await asyncio.sleep(0.2)
        assert not waiting.done() and not standby.held
        assert lines == [f"trainer m: another trainer of m is active here (pid {os.getpid()}, "
                         f"{tmp_path}/trainers/m.lock); standing by to take over when it exits"]
        active.release()
        assert await asyncio.wait_for(waiting, 1) and standby.held
        assert lines[-1].startswith(f"trainer m: taking over from pid {os.getpid()} after ")
        assert standby.holder() == str(os.getpid())

    asyncio.run(scenario())


def test_a_standby_told_to_stop_gives_up_without_the_lock(tmp_path) -> None:
    async def scenario() -> bool:
        active, standby = ModelLock(tmp_path, "m"), ModelLock(tmp_path, "m")
        assert active.try_take() and not standby.try_take()
        stop = asyncio.Event()
        waiting = asyncio.create_task(standby.take(stop, lambda line: None))
        await asyncio.sleep(0.1)
        stop.set()
        active.release()  # free at the same moment: a standby that was told to stop still does not take it
        return await asyncio.wait_for(waiting, 1)

    assert asyncio.run(scenario()) is False
