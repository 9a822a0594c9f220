"""Example of sgrld.Metric, sgrld.IdentityMetric, sgrld.RMSpropMetric, sgrld.WenzelMetric,
sgrld.MongeMetric, sgrld.ShampooMetric, sgrld.get_metric and sgrld.metric_names: the registry
of metrics G, each a small object the one integrator calls."""

import sgrld

print(sgrld.metric_names())  # ['identity', 'monge', 'rmsprop', 'shampoo', 'wenzel']
metric = sgrld.get_metric("monge")(alpha2=2.0)  # the class, then an instance
assert isinstance(metric, sgrld.MongeMetric) and isinstance(metric, sgrld.Metric)
print(metric.tuned)  # the options sgrld.tune chooses besides ℓ
for cls in (sgrld.IdentityMetric, sgrld.RMSpropMetric, sgrld.WenzelMetric, sgrld.ShampooMetric):
    sampler = sgrld.build(cls(), lr=1e-3, num_data=1000)  # an instance instead of a name
    print(type(sampler.metric).__name__)
