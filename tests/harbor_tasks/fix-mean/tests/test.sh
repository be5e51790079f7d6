#!/bin/bash
# Harbor verifier: run the hidden tests against /app, write the reward.
mkdir -p /logs/verifier
if python3 /tests/check_stats.py; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
