"""LiveStorageTracker's lazy sweep: the peak and what is alive at it are those of a sweep after every op."""
import torch

from memopt.cost_model.storage import LiveStorageTracker

MiB = 2 ** 20


class EagerTracker(LiveStorageTracker):
    """The rule the lazy sweep must equal: ask every live storage whether it died after every op."""

    def _note_peak(self) -> None:
        self._sweep()
        if self._upper > self.peak:
            self._take_peak()


def _program():
    """Temporaries that die before the peak, storages kept across it, a view keeping its base alive, and the peak
    at the last op (base + kept + big + small)."""
    base = torch.zeros(MiB // 4)  # 1 MiB, dies on return
    kept = base + 1  # 1 MiB, alive to the end
    for _ in range(3):
        tmp = base * 2  # 1 MiB temporaries, each dying when the next replaces it
    del tmp
    big = base.repeat(4)  # 4 MiB: the peak is kept + big
    view = big[:10]  # a view: no new storage
    del big
    small = kept[:1000] * 3  # 4000 B: the peak
    return kept, view, small


def _run(cls):
    tracker = cls([])
    with tracker:
        tracker.phase = "p"
        kept, view, small = _program()
        current = tracker.current
    return tracker, current


def test_the_lazy_sweep_finds_the_peak_and_its_storages_as_a_sweep_after_every_op_does():
    lazy, lazy_now = _run(LiveStorageTracker)
    eager, eager_now = _run(EagerTracker)
    assert lazy.peak == eager.peak == 6 * MiB + 4000
    assert lazy_now == eager_now == 5 * MiB + 4000  # base died on return; big lives on through the view
    sizes = sorted(n for _, n, _ in lazy.at_peak)
    assert sizes == sorted(n for _, n, _ in eager.at_peak) == [4000, MiB, MiB, 4 * MiB]
    assert all(phase == "p" for _, _, phase in lazy.at_peak)


def test_reset_peak_starts_from_what_is_alive_now():
    tracker = LiveStorageTracker([])
    with tracker:
        a = torch.ones(MiB // 4)
        b = torch.ones(MiB // 4)
        del b
        tracker.reset_peak()
        assert tracker.peak == MiB and [n for _, n, _ in tracker.at_peak] == [MiB]
        c = a * 2
    assert tracker.peak == 2 * MiB and tracker.identity(c) is not None and tracker.identity(torch.ones(1)) is None
