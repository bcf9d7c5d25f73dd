"""The `ray` deploy target: releases as Ray Serve applications on a Ray cluster.

Modules: `cluster` (joining the cluster, nodes, fit, applications and replicas), `replica`
(the Serve deployment that runs one vLLM server per replica), `target` (`RayTarget`, the
deploy-target interface on top of them). Importing this package does not import Ray.
"""
