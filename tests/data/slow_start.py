"""A dataset that takes a minute to unpickle: in a new DataLoader worker, a worker that is still starting."""
import time


class SlowToUnpickle(list):
    def __reduce__(self):
        return _slowly, (list(self),)


def _slowly(items):
    time.sleep(60)
    return SlowToUnpickle(items)
