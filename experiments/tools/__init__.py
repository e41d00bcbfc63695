"""The command-line plumbing and the tools around a trained or exported run.

`cli`: what every command line shares (a mistake is one line, exit 2);
`generate` and `generation`: continuing a prompt with a trained text model;
`export_tpu`: a config's train step lowered for a TPU from any host.
"""
