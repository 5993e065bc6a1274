"""A horovodrun script in the shape of Horovod's pytorch_synthetic_benchmark.py, run unmodified.

horovodrun --gloo -np 2 python horovod_synthetic_script.py [--num-iters N]
"""

import argparse
import timeit

import horovod.torch as hvd
import torch
import torch.nn.functional as F
import torch.optim as optim

parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark")
parser.add_argument("--batch-size", type=int, default=8, help="input batch size")
parser.add_argument("--num-iters", type=int, default=3, help="number of benchmark iterations")
args = parser.parse_args()

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
optimizer = optim.SGD(model.parameters(), lr=0.01 * hvd.size())
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

data = torch.randn(args.batch_size, 32)
target = torch.LongTensor(args.batch_size).random_() % 10


def benchmark_step():
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end="\n" if nl else "")


log(f"Number of workers: {hvd.size()}")
for x in range(args.num_iters):
    time = timeit.timeit(benchmark_step, number=1)
    log(f"Iter #{x}: {args.batch_size / time:.1f} img/sec per CPU")

rank_sum = hvd.allreduce(torch.tensor(float(hvd.rank())), op=hvd.Sum).item()
weights = hvd.allgather(model[0].weight.sum().reshape(1))
print(
    f"hvd rank {hvd.rank()} size {hvd.size()} local {hvd.local_rank()}/{hvd.local_size()} "
    f"rank_sum {rank_sum:.0f} replicas_equal {bool((weights == weights[0]).all())}"
)
