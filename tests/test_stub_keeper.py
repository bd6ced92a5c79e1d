"""pipeline.serving.stub_keeper: held calls are released after their time, never while their pool work runs
(a settable clock, so nothing here depends on the machine's speed)."""

import asyncio
import gc
import weakref

from pipeline.serving.stub_keeper import CallObjects, StubObjectKeeper


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Held:
    """Stands for a pb_utils object (anything weak-referenceable)."""


def held_call() -> tuple[CallObjects, weakref.ref]:
    obj = Held()
    return CallObjects(objects=[obj]), weakref.ref(obj)


def alive(ref: weakref.ref) -> bool:
    gc.collect()
    return ref() is not None


def test_a_call_is_kept_until_its_time_then_released():
    clock = Clock()
    keeper = StubObjectKeeper(hold_s=5.0, clock=clock)
    call, ref = held_call()
    keeper.hold(call)
    del call
    clock.now += 4.9
    keeper.release_expired()
    assert alive(ref)
    clock.now += 0.1
    keeper.release_expired()
    assert not alive(ref) and not keeper.held


def test_a_call_whose_pool_work_still_runs_is_kept_until_it_ends():
    async def main():
        clock = Clock()
        keeper = StubObjectKeeper(hold_s=5.0, clock=clock)
        call, ref = held_call()
        call.pending = asyncio.get_running_loop().create_future()  # an exec()/next() still on the pool
        keeper.hold(call)
        clock.now += 60
        keeper.release_expired()
        assert alive(ref) and len(keeper.held) == 1  # past its time, but its work runs: held hold_s more
        call.pending.set_result(None)
        del call
        clock.now += 4.9
        keeper.release_expired()
        assert alive(ref)  # hold_s counts from the re-hold
        clock.now += 0.1
        keeper.release_expired()
        assert not alive(ref)

    asyncio.run(main())


def test_each_call_waits_for_its_own_time():
    clock = Clock()
    keeper = StubObjectKeeper(hold_s=5.0, clock=clock)
    first, first_ref = held_call()
    keeper.hold(first)
    clock.now += 3
    second, second_ref = held_call()
    keeper.hold(second)
    del first, second
    clock.now += 2
    keeper.release_expired()
    assert not alive(first_ref) and alive(second_ref)
    clock.now += 3
    keeper.release_expired()
    assert not alive(second_ref)
