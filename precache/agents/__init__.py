"""Plan / action / reflect agents answering HotpotQA on one shared trajectory.

- ``data``: HotpotQA questions and the fixed train / dev split.
- ``tools``: offline Retrieve / Lookup / Finish over a question's own paragraphs.
- ``prompt``: the shared token-stream protocol (pieces, stop strings, parsers).
- ``loop``: ``run_episode`` over an engine session.
- ``scoring``: EM and F1 with the SQuAD / HotpotQA normalisation.
- ``gold``: gold trajectories from supporting facts; ``train``: one LoRA adapter per role.
- ``formcheck``: does each adapter make its role's output take the right form?
- ``evaluate``: EM / F1 / agreement over a split; ``cli``: the ``precache`` sub-commands.
"""
