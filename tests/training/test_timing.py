"""Where a step's time went (training/timing.py), on a clock the test moves: the trainer's wait, both idle ratios,
the mean calls in flight, the generation time at full concurrency and the ideal speed-up it implies."""

from __future__ import annotations

from harness_trainer.training.timing import StepClock


def test_a_step_s_figures_come_from_its_waits_its_engines_and_its_rollouts():
    now, engines = [100.0], {"http://a": (0.0, 0.0), "http://b": (5.0, 9.0)}
    clock = StepClock(lambda: dict(engines), clock=lambda: now[0])
    with clock.waiting():  # 3 s waiting for groups, in two waits
        now[0] += 2
    now[0] += 1
    with clock.waiting():
        now[0] += 1
    now[0] += 6  # the step: 10 s in all
    engines.update({"http://a": (6.0, 12.0), "http://b": (9.0, 17.0)})  # busy 6 and 4 s of 10; 8 + 8 call-seconds
    figures = clock.figures({"train_time_s": 4.0, "weight_sync_time_s": 1.0}, [8.0, 8.0, 4.0, 4.0], slots=4)
    assert figures == {"step_time_s": 10.0, "wait_for_groups_s": 3.0, "trainer/idle_ratio": 0.3,
                       "rollouter/idle_ratio": 0.5, "calls_in_flight_mean": 2.0,
                       "generation_s": 6.0,  # 24 rollout-seconds over 4 slots
                       "ideal_speedup": round((6 + 5) / 6, 3)}
    now[0] += 5  # the next step starts from this one's end, its waits from zero
    engines["http://c"] = (1.0, 1.0)  # an engine that joined: counted from the next step
    second = clock.figures({}, [], slots=4)
    assert second["step_time_s"] == 5.0 and second["wait_for_groups_s"] == 0.0
    assert second["rollouter/idle_ratio"] == 1.0 and "ideal_speedup" not in second  # nothing ran, nothing trained
