"""Trainer -> rollout-server weight sync, every transport behind one interface.

| module | what |
|---|---|
| ``base`` | ``WeightSync`` (``sync(model, targets, version) -> SyncStats``, ``close()``), ``SyncTargets`` |
| ``factory`` | ``make_weight_sync``: the transport ``rollout.weight_sync.transport`` names |
| ``distributed`` | SGLang's distributed update: NCCL / gloo broadcasts from each sending rank |
| ``tensor`` | ``/update_weights_from_tensor``: serialized buckets over HTTP |
| ``disk`` | an HF checkpoint the servers reload (``/update_weights_from_disk``) |
| ``export`` | what each rank sends in a distributed sync (its dense layers, its experts) |
| ``group`` | the weight-update process group and its HTTP bodies, both ends' |
| ``wire`` | the tensor bodies' format and the receiver's checks, both ends' |

Kept empty on purpose: the rollout server imports ``group`` and ``wire``, which must not pull
in the trainer's side (bridge, megatron) through this package.
"""
