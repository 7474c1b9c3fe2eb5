"""Diagnosis of failed and stuck jobs: the call checks of ``COMMLIB_DEBUG=DETAIL`` (``debug``), the
flight recorder of recent collectives (``flight``), and the job monitor that names missing and failed
ranks through a small store (``monitor``)."""
