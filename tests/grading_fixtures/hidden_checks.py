"""Hidden checks of the fixture course (copied into a --hidden directory by tests/test_grading.py).

HIDDEN-SOURCE-MARKER-7f3a: no grader output may ever contain this line.
"""
from mgpu_helpers.tools.grading import HiddenCheck


class LongVectors(HiddenCheck):
    exercise = "90.1"
    points = 1

    def cases(self, rng):
        return [{"n": rng.randint(200, 400), "k": rng.choice([-1.5, 7.0]), "seed": rng.randrange(10**6)}
                for _ in range(2)]


class WideHalfLayers(HiddenCheck):
    exercise = "90.2"
    points = 1

    def cases(self, rng):
        return [{"fan_in": rng.randint(100, 300), "fan_out": rng.randint(100, 300), "dtype": "float16"}]
