"""On-policy collection: the workflow protocol and its discovery (`workflow`), the runner that
plays a workflow's episodes (`runner`) and the model as the candidate generator and greedy
policy that workflows call (`policy`). Built-in workflows live in `dpojax.workflows`; the KV-cache
sampler in `dpojax.models.sampler`.
"""
