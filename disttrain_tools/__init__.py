"""Tools around the service and the trainer, outside their runtime (which never imports this
package): the ``run`` check (runner, rank_client), demo data (synth), cost calibration, ``inspect``
(inspect_cli, inspect_plot, datastats), ``reorder`` on instance files (reorder_cli), and local
clusters of replicas for tests and benches (localcluster). ``python -m disttrain_tools`` (the
``disttrain`` command) is the command line of all of them and of the service's own commands."""
