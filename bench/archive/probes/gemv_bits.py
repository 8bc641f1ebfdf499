"""Which CPU GEMV arrangements give identical bits (N-path: x[1,K] @ W[K,N])?"""
import torch, itertools
g = torch.Generator().manual_seed(0)
res = {}
for th in (1, 2, 4):
    torch.set_num_threads(th)
    for K, N in [(576, 3072), (1536, 576), (576, 960), (576, 576), (576, 49152), (2048, 1536)]:
        W = torch.randn(2, K, N, generator=g); x = torch.randn(2, 1, K, generator=g)
        torch.set_num_threads(1)
        ref = torch.mm(x[0], W[0])                         # sequential, full width
        torch.set_num_threads(th)
        mm = torch.mm(x[0], W[0])                          # MKL may thread it
        b1 = torch.bmm(x[:1], W[:1])[0]                    # batch of one
        b2 = torch.bmm(x, W)[0]                            # batch of two: one GEMV per thread
        halves = torch.bmm(x[0].expand(2, 1, K), W[0].view(K, 2, N // 2).transpose(0, 1)).reshape(1, N)
        quarters = torch.bmm(x[0].expand(4, 1, K), W[0].view(K, 4, N // 4).transpose(0, 1)).reshape(1, N)
        res[(th, K, N)] = dict(mm=torch.equal(mm, ref), bmm1=torch.equal(b1, ref), bmm2=torch.equal(b2, ref),
                               halves=torch.equal(halves, ref), quarters=torch.equal(quarters, ref))
for k, v in res.items():
    print(k, v)
import platform; print(platform.processor(), open('/proc/cpuinfo').read().split('model name')[1].split('\n')[0])
