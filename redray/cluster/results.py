"""The run's results actor, on the driver's node: host 0's value, any host's failure,
host 0's news for the driver's console, an elastic group's wish to regroup.

Its process imports Ray and nothing of redray's engine (no JAX). The driver keeps it
for its next run (``redray/cluster/kept.py``): a second run would otherwise wait a
second for a new one before its hosts could start.
"""

from __future__ import annotations

import time

import ray

from redray.cluster.kept import Kept, answers


@ray.remote(num_cpus=0)
class Results:
    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Forgets the last run: ready for the next."""
        self.value, self.failures, self.hosts = None, [], {}
        self.regrouping = 0
        self.doing = {}  # rank -> (start-up phase or TRAINED, since): the group's start
        # host 0's messages and progress for the driver's console, numbered from 0;
        # kept until the driver has read them (a run may log for days)
        self.news, self.first_news = [], 0

    def tell(self, event):
        self.news.append(event)

    def read(self, since):
        """The number of the next piece of news, and those from number ``since`` on
        (the driver has shown the ones before: they are forgotten)."""
        del self.news[:since - self.first_news]
        self.first_news = since
        return since + len(self.news), list(self.news)

    def put(self, value):
        self.value = value

    def join(self, rank, actor):
        self.hosts[rank] = actor
        self.doing[rank] = ("user_code", time.time())

    def new_group(self):
        """A new group of hosts starts the job: forget the last one's hosts, failures and
        start."""
        self.hosts.clear()
        self.doing.clear()
        self.failures = []

    def at(self, rank, what, since):
        """Host ``rank`` is in start-up phase ``what`` (``TRAINED``: past its first
        step) since ``since``."""
        self.doing[rank] = (what, since)

    def where(self):
        """Each host's ``(what, since)`` as told by ``at``."""
        return dict(self.doing)

    def fail(self, rank, text, full):
        self.failures.append((rank, text, full))
        # Every host stops now, before a peer waiting in a collective for the failed
        # one is aborted by JAX (a C++ dump on the driver's screen). The driver sees its
        # hosts gone and ends the run (or restarts it, with max_failures).
        for actor in self.hosts.values():
            ray.kill(actor)
        self.hosts.clear()

    def regroup(self, hosts):
        """Host 0: the group ends to regroup on ``hosts`` hosts (no value)."""
        self.regrouping = hosts

    def take_regroup(self):
        regrouping, self.regrouping = self.regrouping, 0
        self.hosts.clear()
        return regrouping

    def get(self):
        return self.value, self.failures


_KEPT = Kept()


def results_actor():
    """A results actor on the driver's node, cleared: the one kept from this driver's
    last run, else a new one (its scheduling: ``on_driver_node``)."""
    from redray.processes.ray_local import on_driver_node

    return _KEPT.take(lambda actor: answers(actor, "reset")) or \
        Results.options(scheduling_strategy=on_driver_node()).remote()


def keep(actor) -> None:
    """Keeps ``actor`` for this driver's next run."""
    _KEPT.keep(actor, ray.kill)
