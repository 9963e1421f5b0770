"""The summarizer's prompt scenes: one YAML file per kind (session_compact, loop_compact).

Shipped inside the package as `proxy.scenes_default` (pyproject.toml maps this folder
there), so an installed wheel runs with a config in any directory; a config's
`scenes_dir` replaces them (proxy/stages/scenes.py reads them).
"""
