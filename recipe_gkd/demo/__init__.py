"""The CPU demo's toy task and its offline-built models (`python -m recipe_gkd.demo.build_assets`)."""
