"""Diagnosis of failed and stuck jobs, one job per module:

- ``flight``: the flight recorder of recent collectives, dumped when things go wrong;
- ``waits``: where each thread waits (written by the group layer's one wait path);
- ``jobstore``: the job's small store, through which ranks tell each other where they wait and who failed;
- ``progress``: publishing and reading where each rank waits, through that store;
- ``watchdog``: the slow path of every wait (publish, judge, fail fast; who arrived, for a timeout);
- ``verdicts``: what went wrong, in words, as pure functions of what the checks saw;
- ``debug``: ``COMMLIB_DEBUG=DETAIL``'s full comparison of every call;
- ``abort``: an uncaught exception on one rank ends the job.
"""
