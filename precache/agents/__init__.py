"""Plan / action / reflect agents answering HotpotQA or ScienceQA on one shared trajectory.

- ``benchmark``: the ``Benchmark`` record (questions, tools, first piece, scoring, gold
  trajectories, adapters) that the loop, evaluation and training take; ``hotpotqa`` by default.
- ``data``: HotpotQA questions and the fixed train / dev split.
- ``tools``: offline Retrieve / Lookup / Finish over a HotpotQA question's own paragraphs.
- ``scienceqa``: ScienceQA questions, their split, option parsing and accuracy;
  ``scienceqa_tools``: offline Image / Lookup / Finish, the header and gold trajectories.
- ``prompt``: the shared token-stream protocol (pieces, stop strings, parsers).
- ``loop``: ``run_episode`` over an engine session.
- ``scoring``: EM and F1 with the SQuAD / HotpotQA normalisation.
- ``gold``: HotpotQA gold trajectories from supporting facts; ``train``: one LoRA adapter per role.
- ``formcheck``: does each adapter make its role's output take the right form?
- ``evaluate``: a benchmark's metrics and agreement over a split; ``cli``: the ``precache`` sub-commands.
"""
