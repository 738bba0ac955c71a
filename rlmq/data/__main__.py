"""``python -m rlmq.data``: print the path of the sample dataset that ships with rlmq."""

from rlmq.data import SAMPLE_DATASET

print(SAMPLE_DATASET)
