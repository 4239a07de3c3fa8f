"""The emulator: predicted step time and memory of a training configuration.

Pure half (stdlib + numpy, no torch): `trace` (what a traced step contains), `devices`
(device profiles and their efficiency model), `network` (collective times), `costs`
(op times), `schedule` (pipeline orders), `simulate` (the step), `metrics`.
Importing this package imports nothing; the torch tracer lives in its own modules.
"""
