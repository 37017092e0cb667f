"""run.py's actions: one Deployment interface (this host, or every host of a hostfile over SSH)
and the verbs run / stop / status / test / plan / bench built on it."""
